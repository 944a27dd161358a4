"""Know within milliseconds when a lease holder exits, even after SIGKILL, without polling.

A pidfd (os.pidfd_open) becomes readable when its process exits; the event loop watches
it like any other file descriptor. The start time recorded in the caller's token is
checked after opening, so a recycled pid is never mistaken for the holder.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from brokerd.procinfo import start_time as process_start_time

log = logging.getLogger("vaccel.brokerd")


class ProcessWatcher:
    """Calls `on_exit(pid, start_time)` once when a watched process exits."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[int, int], None]) -> None:
        self._loop = loop
        self._on_exit = on_exit
        self._fds: dict[tuple[int, int], int] = {}

    def watch(self, pid: int, start_time: int) -> bool:
        """Start watching; False when the process is already gone (or the pid was reused)."""
        key = (pid, start_time)
        if key in self._fds:
            return True
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        # Opened after the pid may have been recycled: make sure it is the same process.
        if process_start_time(pid) != start_time:
            os.close(fd)
            return False
        self._fds[key] = fd
        self._loop.add_reader(fd, self._exited, key)
        return True

    def unwatch(self, pid: int, start_time: int) -> None:
        fd = self._fds.pop((pid, start_time), None)
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def _exited(self, key: tuple[int, int]) -> None:
        self.unwatch(*key)
        try:
            self._on_exit(*key)
        except Exception:  # a bug in a callback must not take the loop's reader down with it
            log.exception("process-exit handler failed for pid %s", key[0])

    def close(self) -> None:
        for key in list(self._fds):
            self.unwatch(*key)
