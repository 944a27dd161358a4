"""Kill the broker again and again while clients loop short jobs; report what happened.

    python scripts/torture_restart.py --kills 200 --clients 6 --gpus 2

Clients loop `vaccel run --gpus 1 --wait 120 -- JOB` on simulated GPUs while the daemon is
SIGKILLed at random points and restarted on the same state. Each job records, from
inside, when it started and ended on which device. At the end the report says how many
runs there were and how they exited, how many jobs ran other than exactly once to
completion, how many pairs of jobs overlapped on one device, how often the queue came
back in another order than it had just before a kill, and how many processes were granted
a second lease while they held one (a reply lost to a kill, asked again, must get the
first lease back). tests/test_torture_restart.py runs a short round of this in `make
test`; `--json` prints the report for it.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "client"))
sys.path.insert(0, str(ROOT))

JOB = """import os, random, sys, time
log = sys.argv[1]
device = os.environ.get("CUDA_VISIBLE_DEVICES", "?")
with open(log, "a") as f:
    f.write(f"start {device} {time.monotonic()!r}\\n")
time.sleep(random.uniform(0.02, 0.25))
with open(log, "a") as f:
    f.write(f"end {device} {time.monotonic()!r}\\n")
"""

CONFIG = """
[leases]
heartbeat_ttl = "10s"
[probe]
refresh_interval = "60s"
"""


def inventory(gpus: int) -> str:
    lines = ["devices:"]
    for i in range(gpus):
        lines += ["  - vendor: nvidia", f"    name: Torture GPU {i}",
                  f"    uuid: GPU-70000000-0000-0000-0000-{i:012d}", f'    pci_bus_id: "0000:{i + 1:02x}:00.0"',
                  "    memory_mib: 16384", '    compute_capability: "8.0"']
    return "\n".join(lines) + "\n"


class Daemon:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.socket = work / "run" / "brokerd.sock"
        self.log = (work / "brokerd.log").open("ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = {**os.environ, "VACCEL_SOCKET": str(self.socket), "PYTHONUNBUFFERED": "1"}
        self.env.pop("VACCEL_LEASE_ID", None)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "brokerd", "--config", str(self.work / "brokerd.toml"),
             "--socket", str(self.socket), "--state-dir", str(self.work / "state"),
             "--inventory", str(self.work / "inventory.yaml")],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the broker exited with {self.proc.returncode}; see {self.work / 'brokerd.log'}")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.socket) + ".id")
                return
            except OSError:
                time.sleep(0.01)
            finally:
                probe.close()
        raise RuntimeError("the broker did not start in 60 s")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def queue_order(daemon: Daemon) -> list[str] | None:
    """The broker's queue, by request id, or None when it does not answer."""
    from vaccel.session.connection import BrokerConnection, BrokerUnavailable

    from vaccel_common.v1 import broker_pb2 as pb

    connection = BrokerConnection(daemon.socket)
    try:
        return [q.request_id for q in connection.call("Status", pb.StatusRequest(), timeout=10).queue]
    except (BrokerUnavailable, Exception):
        return None
    finally:
        connection.close()


def client_loop(daemon: Daemon, jobs: Path, name: str, stop: threading.Event, runs: list) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        log = jobs / f"{name}-{n}.log"
        err = jobs / f"{name}-{n}.err"
        with err.open("w") as stream:
            code = subprocess.call([sys.executable, "-m", "vaccel.cli", "run", "--gpus", "1", "--wait", "120", "--",
                                    sys.executable, str(jobs / "job.py"), str(log)],
                                   env=daemon.env, stderr=stream, stdout=subprocess.DEVNULL, cwd=ROOT)
        runs.append((f"{name}-{n}", code))


_ENDS = {"released", "expired", "revoked", "exit", "lost", "idle", "time_limit"}  # lease_model's end states


def granted_twice(broker_log: Path) -> list[tuple[str, str, str]]:
    """(pid, lease held, lease granted) where the broker granted a process a lease while it
    still held another: what a lost reply asked again must never get (a `vaccel run` asks
    once). Read from the broker's event lines, in order, across every restart."""
    holder_of: dict[str, str] = {}  # lease id -> pid
    held: dict[str, str] = {}  # pid -> the lease it holds
    twice = []
    for line in broker_log.read_text(errors="replace").splitlines():
        words = line.split(" ")
        if len(words) < 5 or not words[4].startswith("lease="):
            continue
        event, lease = words[3], words[4].removeprefix("lease=")
        if event == "grant":
            pid = next((w.removeprefix("pid=").rstrip(":") for w in words if w.startswith("pid=")), "")
            if pid in held:
                twice.append((pid, held[pid], lease))
            held[pid], holder_of[lease] = lease, pid
        elif event in _ENDS and holder_of.get(lease) in held and held[holder_of[lease]] == lease:
            del held[holder_of.pop(lease)]
    return twice


def overlaps(intervals: dict[str, list[tuple[float, float, str]]]) -> list[tuple[str, str, str]]:
    found = []
    for device, spans in intervals.items():
        spans.sort()
        for (_s1, e1, j1), (s2, _e2, j2) in itertools.pairwise(spans):
            if s2 < e1:
                found.append((device, j1, j2))
    return found


def torture(kills: int, clients: int, gpus: int, max_gap_s: float, seed: int, keep: bool) -> dict:
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="vaccel-torture-"))
    (work / "brokerd.toml").write_text(CONFIG)
    (work / "inventory.yaml").write_text(inventory(gpus))
    jobs = work / "jobs"
    jobs.mkdir()
    (jobs / "job.py").write_text(JOB)
    daemon = Daemon(work)
    daemon.start()
    stop = threading.Event()
    runs: list[tuple[str, int]] = []
    threads = [threading.Thread(target=client_loop, args=(daemon, jobs, f"c{i}", stop, runs), daemon=True)
               for i in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    reordered, queued_at_kills, restored_waiting = [], 0, 0
    try:
        for _ in range(kills):
            time.sleep(rng.uniform(0.0, max_gap_s))
            before = queue_order(daemon) or []
            daemon.kill9()
            daemon.start()
            after = queue_order(daemon) or []
            common = [i for i in before if i in set(after)]
            if common != [i for i in after if i in set(before)]:
                reordered.append((before, after))
            queued_at_kills += len(before)
            restored_waiting += len(common)
        stop.set()
        for t in threads:
            t.join(timeout=300)
    finally:
        stop.set()
        daemon.stop()
    elapsed = time.monotonic() - started
    intervals: dict[str, list[tuple[float, float, str]]] = collections.defaultdict(list)
    not_once = []
    for job, _code in runs:
        log = jobs / f"{job}.log"
        lines = log.read_text().split("\n")[:-1] if log.exists() else []
        kinds = [line.split()[0] for line in lines]
        if kinds != ["start", "end"]:
            not_once.append((job, kinds, (jobs / f"{job}.err").read_text()[-300:]))
            continue
        (_, device, t0), (_, _, t1) = (line.split() for line in lines)
        intervals[device].append((float(t0), float(t1), job))
    twice = granted_twice(work / "brokerd.log")
    codes = collections.Counter(code for _, code in runs)
    failures = [(job, code, (jobs / f"{job}.err").read_text()[-300:]) for job, code in runs if code != 0]
    report = {
        "kills": kills, "clients": clients, "gpus": gpus, "seconds": round(elapsed, 1), "runs": len(runs),
        "exit_codes": {str(k): v for k, v in sorted(codes.items())},
        "jobs_not_run_exactly_once": len(not_once), "overlaps": len(overlaps(intervals)),
        "queued_at_kills": queued_at_kills, "restored_waiting": restored_waiting,
        "queue_reordered": len(reordered), "processes_granted_twice": len(twice),
        "examples": {"failures": failures[:3], "not_once": not_once[:3], "overlaps": overlaps(intervals)[:3],
                     "reordered": reordered[:3], "granted_twice": twice[:3]},
        "broker_restarted_lines": sum("broker restarted; still waiting" in p.read_text()
                                      for p in jobs.glob("*.err")),
    }
    if keep:
        report["workdir"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--max-gap", type=float, default=0.5, help="longest pause between kills, seconds")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs) and print it")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    report = torture(args.kills, args.clients, args.gpus, args.max_gap, seed, args.keep)
    report["seed"] = seed
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            if key != "examples":
                print(f"{key}: {value}")
        if any(report["examples"].values()):
            print("examples:", json.dumps(report["examples"], indent=1))
    clean = (set(report["exit_codes"]) == {"0"} and not report["jobs_not_run_exactly_once"]
             and not report["overlaps"] and not report["queue_reordered"] and not report["processes_granted_twice"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
