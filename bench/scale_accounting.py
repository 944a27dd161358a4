"""Cost of accounting as it grows (issue 46): `python -m bench.scale --accounting-rows N[,N...] [--json]`.

For each N a fresh broker's accounting file is filled with N ended leases of 20 users over
the last year, written straight through the project's accounting code
(brokerd.state.accounting.fill: the rows and their day summaries as the daemon keeps them;
not N real leases). Then the broker starts (simulated lab server, 4 devices) and each of
these is timed as the whole CLI process, start to exit:

- `vaccel report --since 1y` as root, and as an ordinary user (uid 61001: no account needed);
- `vaccel report --by lease --csv --since 1y` as root, and whether it is complete (a header
  and one line per lease);
- three users' `vaccel report --since 1y` at once (all answered?), with a `vaccel status`
  of a fourth user timed meanwhile;
- the daemon's RSS before the reports and a moment after them.

Printed, never asserted. Goal: a year's report under a second for anyone, the export of
any size complete, memory back to where it was.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.startup import vaccel_command
from bench.testbeds.broker import DEFAULT_CONFIG, LAB_INVENTORY, Broker

USERS = 20
FIRST_UID = 61001  # the lab's users: bare uids (the benchmark runs as root)
YEAR_S = 365 * 86400.0
STATES = ("released", "released", "released", "expired", "holder_exited", "revoked")
GOAL_S = 1.0


def lab_year(n: int, now: float, seed: int = 46) -> Iterator[Any]:
    """n ended leases of USERS users spread over the year before `now`."""
    from brokerd.state.report import UsageRow

    rng = random.Random(seed)
    devices = [f"GPU-sim-{i}" for i in range(4)]
    for i in range(n):
        granted = now - YEAR_S + 3600 + rng.random() * (YEAR_S - 7200)
        held = min(rng.expovariate(1 / 7200), 2 * 86400)
        uid = FIRST_UID + rng.randrange(USERS)
        yield UsageRow(lease_id=f"bench-{i:08d}", uid=uid, user=f"lab{uid - FIRST_UID + 1:02d}", gid=uid,
                       devices=tuple(rng.sample(devices, rng.choice((1, 1, 1, 2)))), granted_at=granted,
                       ended_at=min(granted + held, now - 60), wait_s=rng.expovariate(1 / 120),
                       state=rng.choice(STATES), time_limit_s=rng.choice((0.0, 4 * 3600.0)))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def _timed(broker: Broker, args: list[str], uid: int = 0) -> tuple[float, subprocess.CompletedProcess[bytes]]:
    env = {**broker.env, "HOME": "/tmp"}
    start = time.perf_counter()
    done = subprocess.run([*vaccel_command(), *args], env=env, capture_output=True, timeout=600,
                          user=uid or None, group=uid or None, extra_groups=[] if uid else None)
    return time.perf_counter() - start, done


def _ok(done: subprocess.CompletedProcess[bytes]) -> bool:
    return done.returncode == 0


def measure(n: int) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-acct-", dir="/tmp"))
    broker = None
    try:
        from brokerd.state.accounting import DB_NAME, fill

        started = time.perf_counter()
        rows = fill(workdir / "state", lab_year(n, time.time()))
        fill_s = time.perf_counter() - started
        db = workdir / "state" / DB_NAME
        db_mb = sum(p.stat().st_size for p in db.parent.glob(DB_NAME + "*")) / 1e6
        broker = Broker(workdir, LAB_INVENTORY, DEFAULT_CONFIG).start(timeout=600)
        for folder in (workdir, broker.socket.parent):  # the ordinary users reach the socket
            os.chmod(folder, 0o755)
        assert broker.proc is not None
        pid = broker.proc.pid
        _timed(broker, ["status"])  # the daemon has settled (its day summaries are in place)
        rss_before = _rss_mb(pid)
        root_s, root = _timed(broker, ["report", "--since", "1y"])
        user_s, user = _timed(broker, ["report", "--since", "1y"], uid=FIRST_UID)
        csv_s, exported = _timed(broker, ["report", "--by", "lease", "--csv", "--since", "1y"])
        csv_lines = exported.stdout.count(b"\n")
        with ThreadPoolExecutor(4) as pool:
            three = [pool.submit(_timed, broker, ["report", "--since", "1y"], FIRST_UID + k) for k in range(3)]
            status = pool.submit(_timed, broker, ["status"], FIRST_UID + 3)
            reports = [f.result() for f in three]
            status_s, status_done = status.result()
        time.sleep(2.0)
        rss_after = _rss_mb(pid)
        return {
            "rows": rows, "db_mb": round(db_mb, 1), "fill_s": round(fill_s, 1),
            "report_root_s": round(root_s, 3) if _ok(root) else None,
            "report_user_s": round(user_s, 3) if _ok(user) else None,
            "csv_ok": _ok(exported) and csv_lines == rows + 1, "csv_rows": max(csv_lines - 1, 0),
            "csv_s": round(csv_s, 3),
            "concurrent_ok": all(_ok(done) for _, done in reports),
            "concurrent_max_s": round(max(s for s, _ in reports), 3),
            "status_meanwhile_s": round(status_s, 3) if _ok(status_done) else None,
            "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1),
            "errors": [d.stderr.decode(errors="replace")[-300:] for d in (root, user, exported) if not _ok(d)],
        }
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def run(counts: list[int]) -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "users": USERS, "goal_s": GOAL_S, "accounting": [measure(n) for n in counts]}


def render(result: dict[str, Any]) -> str:
    def s(value: float | None) -> str:
        return "failed" if value is None else f"{value:.2f}"

    lines = [f"accounting: N ended leases of {result['users']} users over a year; {result['cpus']} CPU(s); "
             "times are whole CLI processes", "",
             f"{'rows':>9}{'db MB':>8}{'fill s':>8}{'report root s':>15}{'user s':>8}{'csv s':>8}{'csv ok':>8}"
             f"{'3 at once':>11}{'max s':>7}{'status s':>10}{'RSS before':>12}{'after MB':>10}"]
    for r in result["accounting"]:
        lines.append(f"{r['rows']:>9}{r['db_mb']:>8.1f}{r['fill_s']:>8.1f}{s(r['report_root_s']):>15}"
                     f"{s(r['report_user_s']):>8}{r['csv_s']:>8.2f}{'yes' if r['csv_ok'] else 'NO':>8}"
                     f"{'ok' if r['concurrent_ok'] else 'FAILED':>11}{r['concurrent_max_s']:>7.2f}"
                     f"{s(r['status_meanwhile_s']):>10}{r['rss_before_mb']:>12.1f}{r['rss_after_mb']:>10.1f}")
        lines += [f"  error: {e}" for e in r["errors"]]
    lines.append(f"goal: a year's report under {GOAL_S:.0f} s for anyone, the export complete, memory given back")
    return "\n".join(lines)
