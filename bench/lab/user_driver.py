"""One lab user's jobs against a vaccel broker: a process of its own, run as that user's
uid (the broker knows people by the kernel's word), each job a thread with its own
LeaseSession, as a real client holds a lease.

    python -m bench.lab.user_driver SOCKET < plan

stdin: one JSON line {"jobs": [{"id", "at", "gpus", "hold", "time", "reservation"}]}
(real seconds after the replay's start: `at` when to ask, `hold` how long to hold, `time`
the time limit to give, 0 for none), then, once this process has printed "ready", a line
with the replay's start as Unix time. stdout: one JSON line per job as it ends:
{"id", "asked", "granted", "ended"} (Unix times), "lease", "devices" (uuids) or {"id", "error"}.
"""

from __future__ import annotations

import json
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


def main() -> int:
    socket = sys.argv[1]
    plan = json.loads(sys.stdin.readline())
    _say({"ready": True})
    start = float(sys.stdin.readline())
    threads = [threading.Thread(target=run_job, args=(socket, start, job), daemon=True) for job in plan["jobs"]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
