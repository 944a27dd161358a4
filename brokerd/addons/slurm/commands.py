"""Slurm's programs, run as asyncio subprocesses so the broker's event loop never waits on
them: `salloc --no-shell` as the requesting user (an Allocation), `scancel` and
`squeue --json` as the daemon.

The user's own Slurm identity is what makes the allocation theirs (their limits, QOS,
accounting): the daemon, as root, drops to the user with `setpriv` before salloc runs. That
salloc is then the user's own process: they may read its arguments, write into its pipes
(pidfd_getfd) or drive it (ptrace). So nothing it prints names the job: each request puts
a mark of its own in the job's comment (`--comment=vaccel-request:<random>`), and the job
is the one Slurm shows with that mark and the requester's uid (brokerd/addons/slurm/claims.py).
What salloc prints only says when to look, and why it gave up.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import time
from dataclasses import dataclass, field

from brokerd.addons.slurm.jobs import SlurmJob, SlurmReadError, parse_jobs
from brokerd.base.process import Holder
from vaccel_common.text import printable

COMMAND_TIMEOUT_S = 10.0
EXIT_GRACE_S = 10.0  # after SIGTERM, before SIGKILL (a salloc its user stopped hears nothing)


def _env() -> dict[str, str]:
    """The daemon's environment without any job's SLURM_* (SLURM_CONF stays: it names the cluster)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def job_name(command: str) -> str:
    """`vaccel: python train.py` (printable, short: squeue shows it)."""
    return printable(f"vaccel: {command or 'lease'}").replace("\n", " ")[:120]


def request_mark() -> str:
    """A new request's mark: the job comment only the job the broker asks for carries (it
    is random, and the requester's own jobs are the only ones it is looked for among)."""
    return f"vaccel-request:{secrets.token_hex(16)}"


@dataclass
class Allocation:
    """One `salloc --no-shell` as a user, whose job carries `mark`. What it prints is news
    (`changed` is set, `news_at` moves: time to read Slurm), its error lines are kept for a
    refusal, and `done` once it exits. The user can write into its pipe: none of this
    decides a grant.

    Its stderr is a pipe of our own making (not asyncio's subprocess pipe, whose wait()
    lasts as long as any copy of the pipe stays open): `finish` closes our end once salloc
    has exited, so a copy the user keeps holds nothing of the daemon's."""

    process: asyncio.subprocess.Process
    mark: str
    stream: asyncio.StreamReader
    pipe: asyncio.ReadTransport
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    immediate: bool = False  # --immediate: given up at once when Slurm cannot start it now
    news_at: float = 0.0  # time.monotonic() of salloc's last line or exit
    done: bool = False
    errors: list[str] = field(default_factory=list)
    _exit_seen: bool = False

    async def follow(self) -> None:
        """Read salloc's messages until its pipe closes (run as a task)."""
        while True:
            try:
                raw = await self.stream.readline()
            except ValueError:  # a line past the reader's limit: not salloc's words; dropped
                continue
            if not raw:
                break
            line = raw.decode(errors="replace").strip()
            if line.startswith("salloc: error:") and len(self.errors) < 10:
                self.errors.append(line.removeprefix("salloc: error:").strip()[:500])
            self._news()
        await self.process.wait()
        self.done = True
        self._news()

    def check_exit(self) -> bool:
        """Whether salloc has exited, even while a copy of its pipe someone took stays open;
        the first time that is seen, it is news (Slurm is read again)."""
        exited = self.done or self.process.returncode is not None
        if exited and not self._exit_seen:
            self._exit_seen = True
            self._news()
        return exited

    def _news(self) -> None:
        self.news_at = time.monotonic()
        self.changed.set()

    def stop(self) -> None:
        """End salloc if it still waits (scancel of its job is what frees Slurm's side)."""
        if not self.check_exit():
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()

    async def finish(self) -> None:
        """Once salloc has exited (killed if it outlives a stop by EXIT_GRACE_S), close our end
        of its pipe (run as a task when the request is over)."""
        try:
            if self.process.returncode is None:
                try:
                    await asyncio.wait_for(self.process.wait(), EXIT_GRACE_S)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        self.process.kill()
                    await self.process.wait()
        finally:
            self.pipe.close()


class SlurmCommands:
    """The programs, for one node (`node`), partition and GRES name."""

    def __init__(self, node: str, partition: str = "", gres: str = "gpu") -> None:
        self.node = node
        self.partition = partition
        self.gres = gres

    def allocate_argv(self, holder: Holder, gpus: int, time_limit_s: float, command: str, mark: str, *,
                      immediate: bool) -> list[str]:
        argv = ["salloc", "--no-shell", "--nodes=1", f"--nodelist={self.node}", f"--gres={self.gres}:{gpus}",
                f"--job-name={job_name(command)}", f"--comment={mark}"]
        if time_limit_s:
            argv.append(f"--time={max(1, math.ceil(time_limit_s / 60))}")  # Slurm counts minutes
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if immediate:
            argv.append("--immediate=1")
        if holder.uid != os.geteuid():
            argv = ["setpriv", f"--reuid={holder.uid}", f"--regid={holder.gid}", "--init-groups", *argv]
        return argv

    async def allocate(self, holder: Holder, gpus: int, time_limit_s: float, command: str, *,
                       immediate: bool = False) -> Allocation:
        """Start salloc as the holder's user; the Allocation fills in as its `follow()`
        (the caller's task) reads what salloc says."""
        mark = request_mark()
        argv = self.allocate_argv(holder, gpus, time_limit_s, command, mark, immediate=immediate)
        read_end, write_end = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=write_end,
                env=_env(), cwd="/")
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        stream = asyncio.StreamReader()
        pipe, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(read_end, "rb", buffering=0))
        return Allocation(process, mark, stream, pipe, immediate=immediate)

    async def _run(self, *argv: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=_env())
        try:
            out, err = await asyncio.wait_for(process.communicate(), COMMAND_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
            raise
        return process.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    async def cancel(self, job_id: int) -> str:
        """scancel the job (as the daemon: root may cancel anyone's); "" or the error."""
        code, _, err = await self._run("scancel", str(job_id))
        return "" if code == 0 else err.strip() or f"scancel exited with {code}"

    async def jobs(self) -> list[SlurmJob]:
        """Every job slurmctld knows, from `squeue --json` (22.05 lists them all whatever
        the filters); raises OSError when they cannot be read."""
        code, out, err = await self._run("squeue", "--json")
        if code != 0:
            raise OSError(f"squeue --json failed ({code}): {err.strip()}")
        try:
            return parse_jobs(out, self.gres)
        except SlurmReadError as exc:
            raise OSError(str(exc)) from None
