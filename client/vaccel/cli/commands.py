"""The commands that live outside full.py, each in its own module with a
`register(sub, common)` that adds its subparser. Adding a command = one line here."""

from __future__ import annotations

import argparse
import importlib

# module name -> registered by its register(sub, common)
COMMAND_MODULES: tuple[str, ...] = (
    "vaccel.cli.shell",
    "vaccel.kernel.cli",
    "vaccel.cli.report",
    "vaccel.cli.reserve",
)


def register_all(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, common)
