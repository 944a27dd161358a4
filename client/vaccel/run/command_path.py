"""Finding the command `vaccel run` will start, before it asks for devices.

A mistyped command used to be found only after the wait and the grant: `vaccel run --
nonexistent-cmd` queued, took a GPU and then exited 127. The command gets our PATH (the
lease changes only the device variables), so it is looked up here, the way the shell and
execvp look it up, and a missing one is said at once with the shell's statuses: 127 not
found, 126 found but not executable. (Not shutil.which: importing shutil costs every
`vaccel run` ~3.5 ms, see vaccel/cli/parser.py.)
"""

from __future__ import annotations

import os

NOT_FOUND = 127  # the shell's status for a command that does not exist
NOT_EXECUTABLE = 126  # ... and for one that exists but cannot be run


class CommandNotFound(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _runnable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_command(name: str, path: str | None = None) -> str:
    """The file `name` runs, searched on `path` (default: $PATH) unless it has a slash;
    CommandNotFound (with the shell's exit status) when there is none."""
    if "/" in name:
        if _runnable(name):
            return name
        if not os.path.exists(name):
            raise CommandNotFound(f"{name}: no such file", NOT_FOUND)
        why = "is a directory" if os.path.isdir(name) else "is not executable (chmod +x?)"
        raise CommandNotFound(f"{name}: {why}", NOT_EXECUTABLE)
    found_unrunnable = ""
    for folder in (os.environ.get("PATH", os.defpath) if path is None else path).split(os.pathsep):
        candidate = os.path.join(folder or ".", name)
        if _runnable(candidate):
            return candidate
        if not found_unrunnable and os.path.isfile(candidate):
            found_unrunnable = candidate
    if found_unrunnable:
        raise CommandNotFound(f"{name}: {found_unrunnable} is not executable", NOT_EXECUTABLE)
    raise CommandNotFound(f"{name}: command not found (nothing was leased)", NOT_FOUND)
