"""Faults injected at lab times while a trace replays against vaccel (`--faults SPEC`),
and what they cost: did every job complete, was a device ever granted twice, is every
ended lease in the accounting.

SPEC is comma-separated, each a fault and when, in lab time:
    kill9=45m        the daemon killed with SIGKILL every 45 lab minutes, started again at once
    restart=6h       a clean restart (SIGTERM, start) every 6 lab hours
    enospc=3h        every 3 lab hours the state directory's file system (a tmpfs of its own)
                     filled for ENOSPC_FOR_S lab seconds, then emptied
    clock=+10m@5h    the daemon's wall clock stepped by +10 minutes once, at 5 lab hours
                     (through VACCEL_TEST_WALL_STEP_FILE: brokerd/base/clock.py)

The enospc fault mounts a tmpfs and so needs root. Figures are printed, never asserted
(tests/test_faults_replay.py asserts the short form).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lab.plan import Compression
from vaccel_common.units import parse_duration

KINDS = ("kill9", "restart", "enospc", "clock")
ENOSPC_FOR_S = 1800.0  # lab seconds the disk stays full
STATE_FS_MIB = 64
START_TRIES = 30


@dataclass(frozen=True)
class Fault:
    kind: str
    every_s: float = 0.0  # lab seconds between two (kill9, restart, enospc)
    at_s: float = 0.0  # lab time of the one step (clock)
    step_s: float = 0.0  # the clock's step


def parse(spec: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, value = part.partition("=")
        if kind not in KINDS or not value:
            raise ValueError(f"fault {part!r}: want one of {', '.join(k + '=...' for k in KINDS)}")
        if kind == "clock":
            step, _, at = value.partition("@")
            sign = -1.0 if step.startswith("-") else 1.0
            faults.append(Fault(kind, at_s=parse_duration(at or "0s"), step_s=sign * parse_duration(step.lstrip("+-"))))
        else:
            faults.append(Fault(kind, every_s=parse_duration(value)))
    return faults


def schedule(faults: list[Fault], horizon_s: float) -> list[tuple[float, Fault]]:
    """Every injection up to `horizon_s` lab seconds, in order."""
    out = []
    for fault in faults:
        if fault.kind == "clock":
            out.append((fault.at_s, fault))
            continue
        t = fault.every_s
        while fault.every_s > 0 and t < horizon_s:
            out.append((t, fault))
            t += fault.every_s
    return sorted(out, key=lambda x: x[0])


class Injector:
    """Runs one replay's faults against its broker (bench/testbeds/broker.py)."""

    def __init__(self, faults: list[Fault], compression: Compression, horizon_s: float) -> None:
        self.plan = schedule(faults, horizon_s)
        self.compression = compression
        self.injected: dict[str, int] = {}
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mounted: Path | None = None
        self._step_file: Path | None = None
        self._timers: list[threading.Timer] = []

    def prepare(self, broker: Any) -> None:
        """Before the broker starts: a file system of its own for its state, a clock file."""
        if any(f.kind == "enospc" for _, f in self.plan):
            broker.state_dir.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STATE_FS_MIB}m,mode=0755", "tmpfs",
                            str(broker.state_dir)], check=True)
            self._mounted = broker.state_dir
        self._step_file = broker.workdir / "wall-step"
        self._step_file.write_text("0\n")
        broker.env["VACCEL_TEST_WALL_STEP_FILE"] = str(self._step_file)

    def start(self, broker: Any, start: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(broker, start), daemon=True)
        self._thread.start()

    def _run(self, broker: Any, start: float) -> None:
        for at, fault in self.plan:
            if self._stop.wait(max(0.0, start + self.compression.real(at) - time.time())):
                return
            try:
                self._inject(broker, fault, start)
            except Exception as exc:
                self.problems.append(f"{fault.kind} at {at:.0f}s: {exc}")
            self.injected[fault.kind] = self.injected.get(fault.kind, 0) + 1

    def _inject(self, broker: Any, fault: Fault, start: float) -> None:
        if fault.kind == "kill9":
            broker.kill9()
            self._start(broker)
        elif fault.kind == "restart":
            broker.stop()
            self._start(broker)
        elif fault.kind == "clock":
            assert self._step_file is not None
            self._step_file.write_text(f"{fault.step_s}\n")
        elif fault.kind == "enospc":
            self._fill(broker.state_dir, self.compression.real(ENOSPC_FOR_S))

    def _start(self, broker: Any) -> None:
        """Start it again as systemd would (Restart=on-failure), each failed start counted."""
        for _ in range(START_TRIES):
            try:
                broker.start()
                return
            except RuntimeError as exc:
                self.problems.append(f"a start failed: {str(exc)[-300:]}")
                self._stop.wait(1.0)
        raise RuntimeError(f"the daemon did not start in {START_TRIES} tries")

    def _fill(self, state_dir: Path, for_s: float) -> None:
        filler = state_dir / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as f:
            block = b"\0" * (1 << 20)
            while True:
                f.write(block)
                f.flush()
        emptying = threading.Timer(for_s, lambda: filler.unlink(missing_ok=True))
        emptying.daemon = True
        emptying.start()
        self._timers.append(emptying)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        for timer in self._timers:  # a disk still full is emptied now
            timer.cancel()
            timer.function()

    def unmount(self) -> None:
        if self._mounted is not None:
            subprocess.run(["umount", "-l", str(self._mounted)], check=False)
            self._mounted = None


def accounting_rows(state_dir: Path) -> dict[str, tuple[list[str], float, float]]:
    """lease id -> (devices, granted_at, ended_at), as the daemon's accounting file has them."""
    path = state_dir / "accounting.db"
    if not path.exists():
        return {}
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return {r[0]: (json.loads(r[1]), r[2], r[3])
                for r in db.execute("SELECT lease_id, devices, granted_at, ended_at FROM usage")}


def double_grants(held: list[tuple[str, list[str], float, float]]) -> list[tuple[str, str, str, float]]:
    """Pairs of leases that held one device at once: (lease, devices, from, to) each, as
    the daemon's accounting has them. Not by the drivers' clocks: a lease the daemon ended
    (a time limit reached) is heard of at its holder's next heartbeat, by when the device
    may be someone else's; that is a lease ending, not a device granted twice. The
    accounting's times are the wall clock's: a step back would make false pairs."""
    by_device: dict[str, list[tuple[float, float, str]]] = {}
    for lease, devices, begin, end in held:
        for device in devices:
            by_device.setdefault(device, []).append((begin, end, lease))
    pairs = []
    for device, spans in by_device.items():
        spans.sort()
        for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
            if begin < end:
                pairs.append((device, first, second, end - begin))
    return pairs


def report(injector: Injector, expected: int, records: list[dict[str, Any]],
           rows: Callable[[], dict[str, tuple[list[str], float, float]]]) -> dict[str, Any]:
    """The "faults" figures of one system's replay."""
    done = [r for r in records if "error" not in r]
    held = [lease for r in done for lease in r.get("leases", ())]
    accounted = rows()
    twice = double_grants([(lease, *row) for lease, row in accounted.items()])
    return {"injected": dict(injector.injected), "jobs_expected": expected, "jobs_completed": len(done),
            "jobs_lost": expected - len(done), "double_grants": len(twice), "double_grant_pairs": twice[:10],
            "accounting_rows_missing": sum(lease not in accounted for lease in held),
            "errors": [r["error"] for r in records if "error" in r][:10], "problems": injector.problems}


def lab_horizon(submits: list[float]) -> float:
    return max(submits, default=0.0)


def enospc_needs_root(faults: list[Fault]) -> str:
    if any(f.kind == "enospc" for f in faults) and os.geteuid() != 0:
        return "the enospc fault mounts a tmpfs for the state directory: it needs root"
    return ""
