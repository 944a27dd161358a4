"""The commands that live outside cli.py, each in its own module with a
`register(sub, common)` that adds its subparser. Adding a command = one line here."""

from __future__ import annotations

import argparse
import importlib
import sys

# module name -> registered by its register(sub, common)
COMMAND_MODULES: tuple[str, ...] = (
    "vaccel.shell",
    "vaccel.kernel.cli",
    "vaccel.cli_report",
    "vaccel.cli_reserve",
)


def register_all(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    # The commands raise vaccel.cli.CliError. Run as `python -m vaccel.cli`, the running
    # module is __main__, and importing vaccel.cli would make a second one whose CliError
    # the running one does not catch (a traceback instead of one line): share the one.
    running = sys.modules.get("__main__")
    if getattr(getattr(running, "__spec__", None), "name", None) == "vaccel.cli":
        sys.modules.setdefault("vaccel.cli", running)  # type: ignore[arg-type]
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, common)
