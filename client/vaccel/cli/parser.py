"""argparse, sized without shutil.

argparse builds a help formatter for every `add_argument` (to check the metavar), and
the formatter asks shutil for the terminal's width. shutil's import (bz2, lzma, fnmatch)
costs every `vaccel run` ~3.5 ms for help text it never prints. `Parser` is argparse's
parser with formatters that ask the terminal the way shutil.get_terminal_size does:
$COLUMNS first, then the terminal on stdout, else 80 columns. Its subparsers are
`Parser`s too (argparse builds them with the parent's class).

It also keeps the CLI's promise of one-line errors: a usage mistake is one line naming the
command and its --help, not argparse's usage block, and an option that looks like another
is named (`vaccel status --jsn`: did you mean --json?). A value that starts with a minus
and a digit (`--time -5m`) is read as the option's value, so its own check can say what is
wrong with it, rather than "expected one argument".
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, NoReturn


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
        # argparse takes "-5" as a value but "-5m" as an unknown option (no option here
        # starts with a digit, so nothing else is read differently).
        self._negative_number_matcher = re.compile(r"^-\d")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")

    def unrecognized(self, words: list[str]) -> NoReturn:
        """Refuse arguments this command does not take, naming the option meant if one is close."""
        import difflib  # only on this error path

        first = words[0].split("=", 1)[0]
        known = [option for action in self._actions for option in action.option_strings]
        close = difflib.get_close_matches(first, known, n=1, cutoff=0.6) if first.startswith("-") else []
        hint = f"; did you mean {close[0]}?" if close else ""
        self.error(f"unrecognized argument{'s' if len(words) > 1 else ''}: {' '.join(words)}{hint}")
