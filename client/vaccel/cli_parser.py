"""argparse, sized without shutil.

argparse builds a help formatter for every `add_argument` (to check the metavar), and
the formatter asks shutil for the terminal's width. shutil's import (bz2, lzma, fnmatch)
costs every `vaccel run` ~3.5 ms for help text it never prints. `Parser` is argparse's
parser with formatters that ask the terminal the way shutil.get_terminal_size does:
$COLUMNS first, then the terminal on stdout, else 80 columns. Its subparsers are
`Parser`s too (argparse builds them with the parent's class).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def terminal_columns() -> int:
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return 80


class _Sized:
    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: int | None = None) -> None:
        super().__init__(prog, indent_increment, max_help_position,  # type: ignore[call-arg]
                         terminal_columns() - 2 if width is None else width)


class HelpFormatter(_Sized, argparse.HelpFormatter):
    pass


class RawDescriptionHelpFormatter(_Sized, argparse.RawDescriptionHelpFormatter):
    pass


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
