"""What bench.scale times from outside the daemon: its CPU and memory from /proc, and whole
CLI processes as a user runs them, start to exit.

The CLI runs as a bystander: a user who holds nothing and waits for nothing (uid 6099999,
a bare number, when the benchmark is root; else the benchmark's own user), since that is
whom the queue's length should not cost. `vaccel run --no-wait --gpus 1 -- true` on a
host whose every device is leased and whose queue is long is refused at once, exit 75
(busy): that refusal is what the user waits for.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.leases import BenchError
from bench.startup import vaccel_command

BYSTANDER_UID = 6_099_999  # below the waiters' uids (bench/scale_clients.py)
EXIT_BUSY = 75  # vaccel run --no-wait on a busy host (vaccel run --help, "exit status")
STATUS = ("status",)
RUN_NO_WAIT = ("run", "--no-wait", "--gpus", "1", "--", "true")


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def bystander() -> int:
    """The uid the timed commands run as."""
    return BYSTANDER_UID if os.geteuid() == 0 else os.geteuid()


def cli_times(socket_path: str, workdir: Path, args: tuple[str, ...], runs: int, expect: int = 0) -> list[float]:
    """Seconds each of `runs` whole `vaccel ARGS` processes took, run as the bystander in
    `workdir` (no contract files there); an exit status other than `expect` is an error."""
    env = {k: v for k, v in os.environ.items() if k not in ("VACCEL_LEASE_ID", "PYTHONDONTWRITEBYTECODE")}
    env["VACCEL_SOCKET"] = socket_path
    as_user: dict[str, Any] = {}
    if os.geteuid() == 0:
        env["HOME"] = str(workdir)
        as_user = {"user": BYSTANDER_UID, "group": BYSTANDER_UID, "extra_groups": []}
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run([*vaccel_command(), *args], env=env, cwd=workdir, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=60, **as_user)
        times.append(time.perf_counter() - start)
        if done.returncode != expect:
            raise BenchError(f"vaccel {' '.join(args)} exited {done.returncode}, not {expect}: "
                             f"{done.stderr.decode(errors='replace')[-500:]}")
    return times
