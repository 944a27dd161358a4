"""One lab user's jobs against a vaccel broker, run as that user's uid (the broker knows
people by the kernel's word): a process for the user, and under it a process for each job,
holding its lease with a LeaseSession of its own, as a lab's user runs each job as a
command of its own. (One process holding all of a user's jobs made one lease reaped by
the broker's enforcement, which signals the lease's holder process, take every other job
of that user with it: not what a lab sees.)

    python -m bench.lab.user_driver SOCKET < plan

stdin: one JSON line {"jobs": [{"id", "at", "gpus", "hold", "time", "reservation"}]}
(real seconds after the replay's start: `at` when to ask, `hold` how long to hold, `time`
the time limit to give, 0 for none), then, once this process has printed "ready" (every
job's process has started), a line with the replay's start as Unix time. stdout: one JSON
line per job as it ends: {"id", "asked", "granted", "ended"} (Unix times), "lease",
"devices" (uuids) or {"id", "error"} (also for a job whose process ended without a word).

    python -m bench.lab.user_driver SOCKET --job     (one job: the same lines, for one job)
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

from vaccel.session.lease import Lease, LeaseError
from vaccel.session.lease_session import LeaseRequest, LeaseSession

_print_lock = threading.Lock()


def _say(record: dict[str, Any]) -> None:
    with _print_lock:
        print(json.dumps(record), flush=True)


def _sleep_until(moment: float) -> None:
    while (left := moment - time.time()) > 0:
        time.sleep(left)


def run_job(socket: str, start: float, job: dict[str, Any]) -> None:
    """Ask at the job's time, hold for its hold (or until the broker ends the lease at its
    time limit), give it back; report the moments. A borrowed lease called back for a
    request within limits ([policy] lend_idle) is a job that checkpoints at the notice and
    asks again for the rest, as its user would: each piece is reported under "runs"."""
    _sleep_until(start + job["at"])
    asked = time.time()
    left = job["hold"]
    runs: list[list[float]] = []
    leases: list[str] = []  # each piece's lease (bench.lab --faults looks for them in the accounting)
    try:
        while True:
            called_back = _hold(socket, job, left, runs, leases)
            left -= runs[-1][1] - runs[-1][0]
            if not called_back or left <= 0.01:
                break
        _say({"id": job["id"], "asked": asked, "granted": runs[0][0], "ended": runs[-1][1], "runs": runs,
              "leases": leases})
    except LeaseError as exc:
        _say({"id": job["id"], "error": str(exc)})


def _hold(socket: str, job: dict[str, Any], hold: float, runs: list[list[float]], leases: list[str]) -> bool:
    """One lease held for `hold` seconds at most; its (granted, ended) goes to `runs`, its id to `leases`.
    True when it ended early because a borrowed lease was called back."""
    lost = threading.Event()
    why: list[str] = []

    def on_lost(_lease: Lease, reason: str) -> None:
        why.append(reason)
        lost.set()

    def on_ending(ending: Any) -> None:  # a borrowed lease called back: checkpoint, give it back now
        if "lent while idle" in getattr(ending, "reason", "") + getattr(ending, "notice", ""):
            why.append("called back")
            lost.set()

    session = LeaseSession(socket, on_lost=on_lost, on_ending=on_ending, say=lambda _line: None)
    try:
        request = LeaseRequest(gpus=job["gpus"], time=job["time"] or None, reservation=job["reservation"],
                               command=f"lab job {job['id']}")
        lease = session.acquire(request)
        granted = time.time()
        leases.append(lease.id)
        if not job["reservation"]:  # a reservation is the user's: it needs no heartbeat
            session.start_heartbeat()
        lost.wait(max(0.0, granted + hold - time.time()))
        ended = time.time()  # before the release: the next grant may come before its reply
        try:
            session.release()
        except LeaseError:
            if not lost.is_set():
                raise  # (a lease that ended meanwhile has nothing to give back)
        runs.append([granted, ended])
        return lease.borrowed and lost.is_set() and ended < granted + hold - 0.01
    finally:
        session.close()


def _one_job(socket: str) -> int:
    job = json.loads(sys.stdin.readline())
    _say({"ready": True})
    run_job(socket, float(sys.stdin.readline()), job)
    return 0


class _JobProcess:
    """One job's process, and its lines passed on to this process's stdout."""

    def __init__(self, socket: str, job: dict[str, Any]) -> None:
        self.job = job
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.lab.user_driver", socket, "--job"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def ready(self) -> bool:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        return bool(line) and json.loads(line).get("ready", False)

    def start(self, start: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(start)
        self.proc.stdin.close()

    def pass_on(self) -> None:
        assert self.proc.stdout is not None
        said = False
        for line in self.proc.stdout:
            said = True
            _say(json.loads(line))
        code = self.proc.wait()
        if not said:  # killed (the broker's reaper signals a lease's holder): the job is lost
            _say({"id": self.job["id"], "error": f"the job's process ended ({code}) without a record"})


def main() -> int:
    socket = sys.argv[1]
    if sys.argv[2:] == ["--job"]:
        return _one_job(socket)
    plan = json.loads(sys.stdin.readline())
    jobs = [_JobProcess(socket, job) for job in plan["jobs"]]
    for job in jobs:
        if not job.ready():
            print(f"the process of job {job.job['id']} did not start", file=sys.stderr, flush=True)
            return 1
    _say({"ready": True})
    start = sys.stdin.readline()
    for job in jobs:
        job.start(start)
    threads = [threading.Thread(target=job.pass_on, daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
