"""The waiting lines of `vaccel run` (issue 33, item 8): one when the request's own place or
reason changes, not when only the queue behind it grew; who holds what in the first line
only, so later lines stay short; and `--quiet` keeps only the grant. Against a real daemon."""

from __future__ import annotations

import subprocess
import threading
import time

from tests.conftest import Broker
from tests.test_broker_integration import leased, status, wait_for


class Waiter:
    """A `vaccel run` in the queue whose stderr lines are collected as they come."""

    def __init__(self, broker: Broker, *options: str) -> None:
        self.proc = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", *options, "--", "true"],
                                     env=broker.env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def waiting(self) -> list[str]:
        return [line for line in self.lines if line.startswith("vaccel: waiting")]

    def finish(self) -> list[str]:
        self.proc.wait(30)
        self._reader.join(10)
        return self.lines


def test_a_line_when_ones_own_place_changes_and_short_after_the_first(broker: Broker):
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--gpus", "4", "--", "sleep", "60"],
                              env=broker.env, stderr=subprocess.DEVNULL)
    waiters: list[Waiter] = []
    try:
        wait_for(lambda: len(leased(broker)) == 4)
        ahead = Waiter(broker)
        wait_for(lambda: len(status(broker)["queue"]) == 1)
        mine = Waiter(broker)
        waiters += [ahead, mine]
        wait_for(mine.waiting)
        quiet = Waiter(broker, "--quiet")
        waiters.append(quiet)
        wait_for(lambda: len(status(broker)["queue"]) == 3)
        behind = [Waiter(broker) for _ in range(2)]  # the queue grows behind mine: mine stays 2nd
        waiters += behind
        wait_for(lambda: len(status(broker)["queue"]) == 5)
        time.sleep(0.5)  # a pass of the broker's queue lines (every 0.1 s) has had its chance
        ahead.proc.terminate()  # mine moves up: that is news
        wait_for(lambda: len(mine.waiting()) == 2)
        first, second = mine.waiting()
        assert first.startswith("vaccel: waiting for 1 GPU: position 2 of 2") and " since " in first, first
        assert second.startswith("vaccel: waiting for 1 GPU: position 1 of 4"), second
        assert " since " not in second and len(second) < 120, second  # no holders line again
    finally:
        holder.terminate()
        holder.wait(10)
    for waiter in waiters[1:]:
        waiter.finish()
    assert mine.proc.returncode == 0 and len(mine.waiting()) == 2, mine.lines
    # --quiet: the grant, nothing else (no queue line, no release line).
    assert quiet.proc.returncode == 0
    assert len(quiet.lines) == 1 and quiet.lines[0].startswith("vaccel: lease l-"), quiet.lines
