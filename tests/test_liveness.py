"""The pidfd watch (brokerd/core/liveness.py): a released process's pidfd lingers within a
bound, answers whether its process still runs, and a token of a process that exited is
refused whether or not the broker still watches it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from brokerd.base.process import Identity, ProcessId
from brokerd.base.procinfo import start_time
from brokerd.core import liveness
from brokerd.core.liveness import ProcessWatcher
from brokerd.edge.identity import TokenAuthority, TokenError


def _child() -> tuple[subprocess.Popen[bytes], ProcessId]:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    start = start_time(child.pid)
    assert start is not None
    return child, ProcessId(child.pid, start)


def _end(child: subprocess.Popen[bytes]) -> None:
    assert child.stdin is not None
    child.stdin.close()
    child.wait(timeout=30)


def test_a_released_process_keeps_its_pidfd_and_is_still_told_of_its_exit():
    async def scenario() -> list[ProcessId]:
        exited: list[ProcessId] = []
        watcher = ProcessWatcher(exited.append, asyncio.get_running_loop())
        child, process = _child()
        try:
            assert watcher.watch(process)
            watcher.release(process)  # it holds nothing now: lingers
            assert watcher.alive(process) is True
            _end(child)
            assert watcher.alive(process) is False  # the pidfd says so before the loop has run
            for _ in range(1000):
                if exited:
                    break
                await asyncio.sleep(0.01)
            assert watcher.alive(process) is None  # told, and forgotten
            return exited
        finally:
            watcher.close()

    assert len(asyncio.run(scenario())) == 1


def test_lingering_pidfds_are_bounded_least_recent_first(monkeypatch):
    monkeypatch.setattr(liveness, "LINGER", 2)

    async def scenario() -> None:
        watcher = ProcessWatcher(lambda _p: None, asyncio.get_running_loop())
        children = [_child() for _ in range(3)]
        try:
            for _, process in children:
                assert watcher.watch(process)
            first, second, third = (p for _, p in children)
            watcher.release(first)
            watcher.release(second)
            assert watcher.watch(first)  # asked again: watched, no longer lingering
            watcher.release(third)  # lingering: second, third
            assert [watcher.alive(p) for p in (first, second, third)] == [True, True, True]
            watcher.release(first)  # three lingering: the least recent (second) is closed
            assert [watcher.alive(p) for p in (first, second, third)] == [True, None, True]
        finally:
            watcher.close()
            for child, _ in children:
                _end(child)

    asyncio.run(scenario())


def test_a_token_is_refused_once_its_watched_process_exits():
    child, process = _child()
    looked_in_proc: list[int] = []

    def started_at(pid: int) -> int | None:
        looked_in_proc.append(pid)
        return start_time(pid)

    async def scenario() -> None:
        watcher = ProcessWatcher(lambda _p: None, asyncio.get_running_loop())
        authority = TokenAuthority(b"k" * 32, 600, started_at=started_at)
        authority.alive = watcher.alive
        token, _ = authority.mint(Identity(os.getuid(), os.getgid(), process.pid, process.start_time))
        try:
            assert watcher.watch(process)
            assert authority.verify(token).pid == process.pid
            assert looked_in_proc == []  # the pidfd answered
            _end(child)
            with pytest.raises(TokenError, match="exited"):
                authority.verify(token)
        finally:
            watcher.close()
        with pytest.raises(TokenError, match="exited"):  # not watched any more: /proc answers
            authority.verify(token)
        assert looked_in_proc == [process.pid]

    asyncio.run(scenario())
