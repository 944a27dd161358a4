"""The lab benchmark's faults in short (bench/lab/faults.py): a few jobs of two users
replayed against a real daemon while it is killed with SIGKILL, restarted, its state
directory's disk filled and its wall clock stepped: every job completes, no device is
ever held by two leases at once, every ended lease is in the accounting."""

from __future__ import annotations

import os

import pytest

from bench.lab import faults, plan, replay_vaccel
from bench.lab.trace import HOUR, Job

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the enospc fault mounts a tmpfs: root only")

SPEED = 180.0  # a lab hour in 20 s
SPEC = "kill9=30m,restart=1h,enospc=45m,clock=+10m@20m"


def jobs() -> list[Job]:
    # Leases held across every fault: some granted before, some asked while the disk is
    # full or the daemon is down, one waiting (3 GPUs on 4 with others held).
    return [Job(1, "ann", 0.0, 1, 1.5 * HOUR), Job(2, "bob", 0.05 * HOUR, 2, 0.7 * HOUR),
            Job(3, "ann", 0.4 * HOUR, 1, 0.5 * HOUR), Job(4, "bob", 0.55 * HOUR, 3, 0.3 * HOUR),
            Job(5, "ann", 0.8 * HOUR, 1, 0.4 * HOUR), Job(6, "bob", 1.05 * HOUR, 2, 0.3 * HOUR),
            Job(7, "ann", 1.5 * HOUR, 1, 0.2 * HOUR)]


def test_a_faulted_replay_loses_nothing():
    compression = plan.Compression(SPEED)
    steps = plan.steps(jobs(), "vaccel", compression)
    outcomes, setup = replay_vaccel.replay(steps, "vaccel", compression, 4, timeout_s=600,
                                           faults=faults.parse(SPEC))
    figures = setup["faults"]
    assert set(figures["injected"]) == set(faults.KINDS), figures
    assert figures["jobs_expected"] == len(steps) == figures["jobs_completed"] == len(outcomes), \
        (figures["errors"], figures["problems"])
    assert figures["jobs_lost"] == 0 and figures["double_grants"] == 0, (figures, setup.get("log"))
    assert figures["accounting_rows_missing"] == 0, figures


def test_a_fault_spec_is_read_as_lab_times():
    kill, clock = faults.parse("kill9=45m,clock=-10m@5h")
    assert (kill.kind, kill.every_s) == ("kill9", 2700.0)
    assert (clock.kind, clock.at_s, clock.step_s) == ("clock", 5 * HOUR, -600.0)
    assert [at for at, _ in faults.schedule([kill], 3 * HOUR)] == [2700.0, 5400.0, 8100.0]
    with pytest.raises(ValueError, match="kill9="):
        faults.parse("reboot=1h")
