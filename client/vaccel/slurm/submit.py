"""`[slurm] mode = "submit"`: on a login node (no GPUs, usually no broker), `vaccel run
--gpus N -- CMD` asks Slurm for the allocation anywhere in the partition and runs CMD on it
with `srun`, printing vaccel's queue lines while the job is pending.

How the client learns the mode: it reads the `[slurm]` table of the broker's config file
(VACCEL_BROKER_CONFIG, default /etc/vaccel/brokerd.toml) with tomllib: the admin writes
`mode = "submit"` there once, whether or not a broker runs on the login node. Inside a
Slurm job (SLURM_JOB_ID set) the job's allocation is the lease instead (slurm_job.py), and
VACCEL_SLURM=off turns both off.

Exit status as `vaccel run`: CMD's (srun passes the task's on, 128+N for a signal), 1 when
Slurm refuses the request, 75 when --no-wait / --wait found no room in time. srun runs in
our process group (a terminal's Ctrl-C reaches it, and --quit-on-interrupt makes one
enough); signals sent to us are forwarded; if we die, srun gets SIGTERM (PR_SET_PDEATHSIG)
and ends the job. On the node, CMD sees the job's GPUs, so `lease()` and `vaccel run` in it
take the job's allocation as their lease. With --contract, CMD runs under `vaccel run
--contract` there, which checks it on the node before CMD starts.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import threading
from typing import NamedTuple

from vaccel_common.paths import BROKER_CONFIG, BROKER_CONFIG_ENV

POLL_INTERVAL_S = 1.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


class SubmitError(Exception):
    """A request submit mode cannot carry (the message says what to do instead)."""


class SubmitSettings(NamedTuple):
    partition: str = ""
    gres: str = "gpu"


def settings(environ: dict[str, str] | None = None) -> SubmitSettings | None:
    """The submit settings when this host is a login node in submit mode, else None."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_ID") or env.get("VACCEL_SLURM") == "off":
        return None
    path = env.get(BROKER_CONFIG_ENV) or BROKER_CONFIG  # strs: every `vaccel run` reads it (not pathlib)
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
    except FileNotFoundError:
        return None
    except OSError as exc:  # unreadable by this user: the broker's business, not ours
        if exc.errno == 13:
            return None
        raise SubmitError(f"{path}: cannot read: {exc.strerror}") from None
    if "submit" not in text:  # the broker host's own config, read by every `vaccel run`: no parse
        return None
    import tomllib

    try:
        table = tomllib.loads(text).get("slurm", {})
    except tomllib.TOMLDecodeError as exc:
        raise SubmitError(f"{path}: not valid TOML: {exc}") from None
    if not isinstance(table, dict) or table.get("mode") != "submit":
        return None
    return SubmitSettings(partition=str(table.get("partition", "")), gres=str(table.get("gres", "gpu")))


def srun_argv(command: list[str], submit: SubmitSettings, *, gpus: int, time_limit_s: float, wait: bool | float,
              comment: str, contract: str | None = None, config: str | None = None) -> list[str]:
    """The srun command line that allocates anywhere in the partition and runs `command`."""
    argv = ["srun", "--quiet", "--quit-on-interrupt", "--nodes=1", "--ntasks=1", f"--gres={submit.gres}:{gpus}",
            f"--job-name=vaccel: {' '.join(command)}"[:120], f"--comment={comment}"]
    if submit.partition:
        argv.append(f"--partition={submit.partition}")
    if time_limit_s:
        argv.append(f"--time={max(1, math.ceil(time_limit_s / 60))}")
    if wait is False:
        argv.append("--immediate=1")
    elif wait is not True:
        argv.append(f"--immediate={max(1, math.ceil(wait))}")
    if contract or config:
        inner = [sys.executable, "-m", "vaccel.cli", "run"]
        inner += ["--contract", os.path.realpath(contract)] if contract else []
        inner += ["--config", os.path.realpath(config)] if config else []
        command = [*inner, "--", *command]
    return argv + command


class _Seen:
    """What squeue said of our job (found by its comment)."""

    def __init__(self) -> None:
        self.job_id = 0
        self.state = ""
        self.reason = ""
        self.ran = False


def _squeue(comment: str, partition: str, seen: _Seen) -> str:
    """One look at the queue: update `seen`; the queue line to print ("" = nothing new)."""
    fmt = "%i|%k|%T|%r|%Q|%V|%P|%N"
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-o", fmt], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 7]
    mine = next((r for r in rows if r[1] == comment), None)
    if mine is None:
        return ""
    seen.job_id, seen.state, seen.reason = int(mine[0]), mine[2], mine[3]
    if seen.state != "PENDING":
        # A job Slurm refuses is still recorded (FAILED, reason BadConstraints): it ran only if
        # it was seen running, or ended for a reason only a started job has.
        seen.ran = seen.ran or seen.state in ("RUNNING", "COMPLETING") or (
            seen.state in ("COMPLETED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY")
            and (seen.reason in ("None", "NonZeroExitCode") or seen.reason.startswith("RaisedSignal")))
        return f"slurm job {seen.job_id} runs on {mine[7]}" if seen.state == "RUNNING" else ""
    part = mine[6]
    pending = sorted((r for r in rows if r[2] == "PENDING" and r[6] == part),
                     key=lambda r: (-int(r[4] or 0), r[5], int(r[0])))
    place = next(i for i, r in enumerate(pending, 1) if r[0] == mine[0])
    return (f"waiting for Slurm: job {seen.job_id} pending ({seen.reason}), position {place} of {len(pending)} "
            f"in partition {part}")


def _watch(comment: str, partition: str, seen: _Seen, done: threading.Event, quiet: bool) -> None:
    last = ""
    while not done.wait(POLL_INTERVAL_S if seen.job_id else 0.2):
        line = _squeue(comment, partition, seen)
        if line and line != last and not quiet:
            print(f"vaccel: {line}", file=sys.stderr, flush=True)
        last = line or last
        if seen.ran:
            return


def run(command: list[str], submit: SubmitSettings, *, gpus: int, time_limit_s: float, wait: bool | float,
        quiet: bool = False, contract: str | None = None, config: str | None = None) -> int:
    """Run `command` in a Slurm allocation of `gpus` GPUs; return its exit status."""
    from vaccel.session.outcome import EXIT_REFUSED, EXIT_TEMPFAIL

    comment = f"vaccel-submit-{os.urandom(6).hex()}"
    argv = srun_argv(command, submit, gpus=gpus, time_limit_s=time_limit_s, wait=wait, comment=comment,
                     contract=contract, config=config)
    import ctypes  # only on the submit path: every `vaccel run` imports this module

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def child_setup() -> None:  # between fork and exec: srun ends its job when we die
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    try:
        proc = subprocess.Popen(argv, preexec_fn=child_setup)
    except FileNotFoundError:
        raise SubmitError("srun is not installed here: submit mode needs Slurm's client programs") from None
    received: list[int] = []

    def forward(signo: int, _: object) -> None:
        received.append(signo)
        proc.send_signal(signo)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    seen, done = _Seen(), threading.Event()
    watcher = threading.Thread(target=_watch, args=(comment, submit.partition, seen, done, quiet), daemon=True)
    watcher.start()
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        done.set()
        watcher.join(timeout=5)
    if not seen.ran:
        _squeue(comment, submit.partition, seen)  # a job that ran and ended between two looks
    if seen.ran:
        return 128 - code if code < 0 else code
    if received and received[-1] in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        return 128 + received[-1]  # interrupted while waiting: srun withdrew the job
    if wait is not True:
        # Slurm records a job --immediate gave up on as CANCELLED or FAILED (BadConstraints)
        # alike, so "no room in time" cannot be told from "never": srun's message says which.
        print(f"vaccel: Slurm did not start it within the wait{_job(seen)}", file=sys.stderr, flush=True)
        return EXIT_TEMPFAIL
    print(f"vaccel: Slurm refused the allocation{_job(seen)}; srun's message above says why", file=sys.stderr,
          flush=True)
    return EXIT_REFUSED


def _job(seen: _Seen) -> str:
    return f" (job {seen.job_id}: {seen.state.lower()}, {seen.reason})" if seen.job_id else ""


def run_from_cli(args: argparse.Namespace, command: list[str], gpus: int, devices: tuple[str, ...],
                 wait: bool | float) -> int | None:
    """`vaccel run` on a login node in submit mode: CMD's exit status; None when this host
    is not in submit mode (the broker is asked as usual)."""
    from vaccel.session.outcome import EXIT_UNAVAILABLE, EXIT_USAGE, CliError
    from vaccel_common.units import parse_duration

    try:
        submit = settings()
    except SubmitError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if submit is None:
        return None
    if devices or args.min_memory:
        raise CliError("--device and --min-memory cannot be asked of Slurm from a login node ([slurm] mode = "
                       "\"submit\"): ask for a number of GPUs (a GRES type or --constraint is Slurm's way)",
                       EXIT_USAGE)
    try:
        time_limit_s = parse_duration(args.time) if args.time else 0.0
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    try:
        return run(command, submit, gpus=gpus, time_limit_s=time_limit_s, wait=wait, quiet=args.quiet,
                   contract=args.contract, config=args.config)
    except SubmitError as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from None
