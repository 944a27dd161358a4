"""Replay a trace against a real vaccel-brokerd on simulated GPUs.

Each lab user is a client process of their own (bench/lab/user_driver.py) under a uid of
their own when we are root (61001, 61002, ...: the broker's fair queue and limits go by
the kernel's uid; no account needs to exist), each job a process of its own under it taking
a lease, holding it, giving it back. The drivers run from a world-readable copy of the client packages, since
the checkout may sit where other users cannot read.

The broker runs with its defaults, each lab duration among them divided by the speed:
`time_default` (24 h), `time_max` (7 d), `fair_half_life` (24 h), `aging` (24 h). The
"vaccel-policy" system adds what docs/policy.md advises a lab to set: `max_devices` at half
the machine per user (or the largest job's GPUs, if more) with `lend_idle`, and every job
gives `--time` (bench/lab/plan.py); "vaccel-policy-nolend" is the cap without lending.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from bench.lab.faults import Fault, Injector, accounting_rows
from bench.lab.faults import report as fault_report
from bench.lab.metrics import Outcome
from bench.lab.plan import DEFAULT_LIMIT_S, MAX_LIMIT_S, Compression, Step
from bench.lab.trace import HOUR

ROOT = Path(__file__).resolve().parents[2]
FIRST_UID = 61001
READY_TIMEOUT_S = 60.0
LEND_NOTICE_S = 300.0  # [policy] lend_notice's default, in lab time
START_MARGIN_S = 1.0  # between the last driver's "ready" and the replay's start


class ReplayError(RuntimeError):
    """A replay failed; the message says where."""


def inventory(devices: int) -> str:
    """`devices` simulated A100s, alike, so any request fits any of them."""
    lines = ["devices:"]
    for i in range(devices):
        lines += ["  - vendor: nvidia", "    name: NVIDIA A100-SXM4-80GB",
                  f"    uuid: GPU-1ab0000-0000-0000-0000-{i + 1:012d}",
                  f'    pci_bus_id: "0000:{0x10 + i:02x}:00.0"', "    memory_mib: 81920",
                  '    compute_capability: "8.0"', '    driver_version: "535.54.03"']
    return "\n".join(lines) + "\n"


def broker_config(system: str, compression: Compression, devices: int, largest: int) -> str:
    """The daemon's config: its defaults at the replay's speed, and the lab's policy
    (`largest`: the most GPUs one job of the trace asks for, which the limit must allow)."""
    def real(lab_s: float) -> str:
        return f'"{compression.real(lab_s):.3f}s"'

    lines = ["[policy]", f"fair_half_life = {real(24 * HOUR)}", f"aging = {real(24 * HOUR)}",
             "[policy.default]", f"time_default = {real(compression.limit(DEFAULT_LIMIT_S))}",
             f"time_max = {real(compression.limit(MAX_LIMIT_S))}"]
    if system.startswith("vaccel-policy"):
        lines.append(f"max_devices = {max(largest, devices // 2)}")
    if system == "vaccel-policy":  # the cap lends what it would idle (docs/policy.md)
        lines[1:1] = ["lend_idle = true", f"lend_notice = {real(LEND_NOTICE_S)}"]
        # A holder hears of a notice at its next heartbeat (a quarter of the TTL): compressed,
        # 5 lab minutes are under 2 real seconds, so the TTL shrinks with it, as a lab's 30 s
        # TTL is to its 5 minutes of notice. (A lease ended unheard is reaped: its job's
        # process would go with it.)
        lines[:0] = ["[leases]", f'heartbeat_ttl = "{max(1.0, compression.real(LEND_NOTICE_S) * 4 / 3):.3f}s"']
    return "\n".join(lines) + "\n"


def _stage(into: Path) -> Path:
    """A world-readable copy of what the drivers import."""
    stage = into / "stage"
    for package in (ROOT / "client" / "vaccel", ROOT / "vaccel_common"):
        shutil.copytree(package, stage / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    (stage / "bench" / "lab").mkdir(parents=True)
    for name in ("bench/__init__.py", "bench/lab/__init__.py", "bench/lab/user_driver.py"):
        shutil.copy(ROOT / name, stage / name)
    for path in [into, stage, *stage.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return stage


class _Driver:
    """One user's process and the records it prints."""

    def __init__(self, user: str, uid: int | None, plan: dict[str, Any], socket: Path, stage: Path, log: IO[bytes]):
        ids = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
        self.user = user
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.lab.user_driver", str(socket)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=stage,
                                     env={"PYTHONPATH": str(stage), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                          "GRPC_ENABLE_FORK_SUPPORT": "0"},
                                     text=True, **ids)  # type: ignore[arg-type]
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(plan) + "\n")
        self.proc.stdin.flush()
        self.records: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            record = json.loads(line)
            if record.get("ready"):
                self.ready.set()
            else:
                self.records.append(record)

    def start(self, at: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{at}\n")
        self.proc.stdin.close()

    def wait(self, deadline: float) -> None:
        self.proc.wait(timeout=max(1.0, deadline - time.time()))
        self._reader.join(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def replay(steps: list[Step], system: str, compression: Compression, devices: int,
           timeout_s: float, faults: list[Fault] | None = None) -> tuple[list[Outcome], dict[str, Any]]:
    """Run the steps against a fresh broker; the jobs' outcomes and how it was set up
    (with `faults`: injected meanwhile, and their figures under "faults", bench/lab/faults.py)."""
    from bench.testbeds.broker import Broker  # a daemon subprocess on a temp socket

    workdir = Path(tempfile.mkdtemp(prefix="vaccel-bench-lab-"))
    drivers: list[_Driver] = []
    broker = None
    injector = Injector(faults, compression, max(s.job.submit_s for s in steps)) if faults else None
    config = broker_config(system, compression, devices, max(s.job.gpus for s in steps))
    try:
        (workdir / "inventory.yaml").write_text(inventory(devices))
        stage = _stage(workdir)
        broker = Broker(workdir, workdir / "inventory.yaml", config)
        if injector is not None:
            injector.prepare(broker)
        broker.start()
        users = sorted({s.job.user for s in steps})
        as_root = os.geteuid() == 0
        with (workdir / "drivers.log").open("wb") as log:
            for number, user in enumerate(users):
                plan = {"jobs": [{"id": s.job.id, "at": compression.real(s.job.submit_s), "gpus": s.job.gpus,
                                  "hold": compression.real(s.hold_s), "time": compression.real(s.time_limit_s),
                                  "reservation": s.reservation} for s in steps if s.job.user == user]}
                drivers.append(_Driver(user, FIRST_UID + number if as_root else None, plan, broker.socket, stage, log))
        ready_by = time.time() + READY_TIMEOUT_S
        for driver in drivers:
            if not driver.ready.wait(max(0.0, ready_by - time.time())):
                raise ReplayError(f"vaccel: the driver of {driver.user} did not start:\n"
                                  f"{(workdir / 'drivers.log').read_text()[-2000:]}")
        start = time.time() + START_MARGIN_S
        for driver in drivers:
            driver.start(start)
        if injector is not None:
            injector.start(broker, start)
        deadline = start + timeout_s
        try:
            for driver in drivers:
                driver.wait(deadline)
        except subprocess.TimeoutExpired:
            raise ReplayError(f"{system}: the replay did not end within {timeout_s:.0f} s") from None
        if injector is None:
            return _outcomes(steps, drivers, start, compression, system, workdir), {"config": config}
        injector.stop()
        broker.stop()  # its accounting written out before it is read
        records = [r for d in drivers for r in d.records]
        figures = fault_report(injector, len(steps), records, lambda: accounting_rows(broker.state_dir))
        return _outcomes(steps, drivers, start, compression, system, workdir, lenient=True), \
            {"config": config, "faults": figures}
    finally:
        for driver in drivers:
            driver.kill()
        if injector is not None:
            injector.stop()
        if broker is not None:
            broker.stop()
        _keep_logs(workdir, system)
        if injector is not None:
            injector.unmount()
        shutil.rmtree(workdir, ignore_errors=True)


def _keep_logs(workdir: Path, system: str) -> None:
    """With VACCEL_LAB_KEEP=DIR, the daemon's log, the drivers' stderr and the state folder
    (journal, accounting) are copied to DIR/SYSTEM before the replay's folder goes: a lost
    job is explained there."""
    keep = os.environ.get("VACCEL_LAB_KEEP")
    if not keep:
        return
    into = Path(keep) / system
    into.mkdir(parents=True, exist_ok=True)
    for name in ("brokerd.log", "drivers.log"):
        if (workdir / name).exists():
            shutil.copy(workdir / name, into / name)
    if (workdir / "state").is_dir():
        shutil.copytree(workdir / "state", into / "state", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("filler", "*.sock"))


def _outcomes(steps: list[Step], drivers: list[_Driver], start: float, compression: Compression,
              system: str, workdir: Path, *, lenient: bool = False) -> list[Outcome]:
    """The completed jobs' moments; a job that failed or left no record fails the replay,
    unless `lenient` (a faulted replay counts them as lost instead)."""
    by_id = {s.job.id: s.job for s in steps}
    records = {r["id"]: r for d in drivers for r in d.records}
    errors = [f"job {i}: {r['error']}" for i, r in records.items() if "error" in r]
    missing = sorted(set(by_id) - set(records))
    if lenient:
        records = {i: r for i, r in records.items() if "error" not in r}
    elif errors or missing:
        detail = "; ".join(errors[:5]) or f"no record of jobs {missing[:10]}"
        raise ReplayError(f"{system}: {len(errors) + len(missing)} job(s) failed: {detail}\n"
                          f"{(workdir / 'drivers.log').read_text()[-2000:]}")
    out = []
    for job_id, r in sorted(records.items()):
        job = by_id[job_id]
        runs = r.get("runs") or []
        out.append(Outcome(job_id, job.user, job.gpus, job.submit_s, compression.lab(r["granted"] - start),
                           compression.lab(r["ended"] - start),
                           tuple((compression.lab(a - start), compression.lab(b - start)) for a, b in runs)
                           if len(runs) > 1 else ()))
    return out
