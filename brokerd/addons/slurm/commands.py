"""Slurm's programs, run as asyncio subprocesses so the broker's event loop never waits on
them: `salloc --no-shell` as the requesting user (an Allocation), `scancel` and `scontrol`
as the daemon.

The user's own Slurm identity is what makes the allocation theirs (their limits, QOS,
accounting): the daemon, as root, drops to the user with `setpriv` before salloc runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
from dataclasses import dataclass, field

from brokerd.addons.slurm.jobs import SlurmJob, parse_jobs
from brokerd.base.process import Holder
from vaccel_common.text import printable

_JOB_LINE = re.compile(r"^salloc: (Pending|Granted) job allocation (\d+)")
COMMAND_TIMEOUT_S = 10.0


def _env() -> dict[str, str]:
    """The daemon's environment without any job's SLURM_* (SLURM_CONF stays: it names the cluster)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def job_name(command: str) -> str:
    """`vaccel: python train.py` (printable, short: squeue shows it)."""
    return printable(f"vaccel: {command or 'lease'}").replace("\n", " ")[:120]


@dataclass
class Allocation:
    """One `salloc --no-shell` as a user: its job id as soon as Slurm prints it, then the
    grant (salloc exits 0) or the error lines it printed. `changed` is set at each news."""

    process: asyncio.subprocess.Process
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    immediate: bool = False  # --immediate: given up at once when Slurm cannot start it now
    job_id: int = 0
    granted: bool = False
    done: bool = False
    errors: list[str] = field(default_factory=list)

    async def follow(self) -> None:
        """Read salloc's messages until it exits (run as a task)."""
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            line = raw.decode(errors="replace").strip()
            match = _JOB_LINE.match(line)
            if match:
                self.job_id = int(match.group(2))
                self.granted = self.granted or match.group(1) == "Granted"
            elif line.startswith("salloc: error:"):
                self.errors.append(line.removeprefix("salloc: error:").strip())
            self.changed.set()
        code = await self.process.wait()
        self.granted = self.granted and code == 0
        self.done = True
        self.changed.set()

    def stop(self) -> None:
        """End salloc if it still waits (scancel of its job is what frees Slurm's side)."""
        if not self.done:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()


class SlurmCommands:
    """The programs, for one node (`node`), partition and GRES name."""

    def __init__(self, node: str, partition: str = "", gres: str = "gpu") -> None:
        self.node = node
        self.partition = partition
        self.gres = gres

    def allocate_argv(self, holder: Holder, gpus: int, time_limit_s: float, command: str, *,
                      immediate: bool) -> list[str]:
        argv = ["salloc", "--no-shell", "--nodes=1", f"--nodelist={self.node}", f"--gres={self.gres}:{gpus}",
                f"--job-name={job_name(command)}"]
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
        argv = self.allocate_argv(holder, gpus, time_limit_s, command, immediate=immediate)
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=_env(), cwd="/")
        return Allocation(process, immediate=immediate)

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

    async def jobs(self, job_id: int = 0) -> list[SlurmJob]:
        """Every job slurmctld knows (or one); raises OSError when scontrol fails."""
        argv = ["scontrol", "--details", "--oneliner", "show", "job"] + ([str(job_id)] if job_id else [])
        code, out, err = await self._run(*argv)
        if code != 0:
            if job_id and "Invalid job id" in err:
                return []
            raise OSError(f"scontrol failed ({code}): {err.strip()}")
        return parse_jobs(out, self.gres)
