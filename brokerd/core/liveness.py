"""Know within milliseconds when a lease holder exits, even after SIGKILL, without polling.

A pidfd (os.pidfd_open) becomes readable when its process exits; the event loop watches
it like any other file descriptor. The start time recorded in the caller's token is
checked after opening, so a recycled pid is never mistaken for the holder.

A process that holds and waits for nothing any more is not forgotten at once: its pidfd
lingers (at most LINGER of them, the least recent closed first), because a training
script or `vaccel run` that just released usually asks again, and the pidfd also answers
"is this token's process still alive?" without a read of /proc (brokerd/edge/identity.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
from collections import OrderedDict
from collections.abc import Callable

from brokerd.base.process import ProcessId
from brokerd.base.procinfo import start_time as process_start_time

log = logging.getLogger("vaccel.brokerd")

LINGER = 256  # pidfds kept for processes that hold nothing: bounded whatever users do


class ProcessWatcher:
    """Calls `on_exit(process)` once when a watched process exits."""

    def __init__(self, on_exit: Callable[[ProcessId], None], loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop  # the running loop at the first watch, when not given
        self._on_exit = on_exit
        self._fds: dict[ProcessId, int] = {}
        self._lingering: OrderedDict[ProcessId, None] = OrderedDict()

    def watch(self, process: ProcessId) -> bool:
        """Start watching; False when the process is already gone (or the pid was reused)."""
        if process in self._fds:
            self._lingering.pop(process, None)
            return True
        try:
            fd = os.pidfd_open(process.pid)
        except ProcessLookupError:
            return False
        # Opened after the pid may have been recycled: make sure it is the same process.
        if process_start_time(process.pid) != process.start_time:
            os.close(fd)
            return False
        self._fds[process] = fd
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._exited, process)
        return True

    def release(self, process: ProcessId) -> None:
        """The process needs no watching now: its pidfd lingers, within LINGER."""
        if process not in self._fds:
            return
        self._lingering[process] = None
        self._lingering.move_to_end(process)
        while len(self._lingering) > LINGER:
            oldest, _ = self._lingering.popitem(last=False)
            self.unwatch(oldest)

    def alive(self, process: ProcessId) -> bool | None:
        """Whether a watched process is still running (its pidfd is not readable yet);
        None when it is not watched, so the caller must look in /proc."""
        fd = self._fds.get(process)
        if fd is None:
            return None
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return not poller.poll(0)

    def unwatch(self, process: ProcessId) -> None:
        self._lingering.pop(process, None)
        fd = self._fds.pop(process, None)
        if fd is not None:
            assert self._loop is not None, "a pidfd is watched only on a loop"
            self._loop.remove_reader(fd)
            os.close(fd)

    def _exited(self, process: ProcessId) -> None:
        self.unwatch(process)
        try:
            self._on_exit(process)
        except Exception:  # a bug in a callback must not take the loop's reader down with it
            log.exception("process-exit handler failed for pid %s", process.pid)

    def close(self) -> None:
        for process in list(self._fds):
            self.unwatch(process)
