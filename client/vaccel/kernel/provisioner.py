"""The Jupyter server's side of the vaccel kernel (entry point `vaccel-provisioner` in
`jupyter_client.kernel_provisioners`): the local provisioner, plus what a kernel that
holds a lease needs from the server.

The lease itself is the kernel process's (see __main__.py): the server never holds one,
so a kernel that dies frees its devices whatever happens to the server. What this adds:

- the start lasts until the kernel holds its lease or is in the queue. Granted at once:
  the start ends with the lease. Queued: the start ends at the first queue message, so the
  waiting kernel is listed (GET /api/kernels, state "starting") and can be deleted (the
  delete ends the process, which leaves the queue); each new queue message goes to the
  server's log, where Jupyter logs kernel start-up;
- when the broker refuses at once (no device free and the kernelspec says `--on-busy
  fail`) the start fails with the broker's message as an HTTP error, which jupyter_server
  answers with that message (POST /api/kernels: 503, JupyterLab's session path: 500), not
  "Unhandled error";
- when the lease ends behind the kernel's back (an admin's revoke, its time limit, idle
  reclaim; or `--max-wait` ran out after the start) the kernel tells us, and Jupyter's
  automatic restart of the dead kernel starts it without a lease (stopped.py), saying
  why in every cell. The restarter's "restart" callback is how an automatic restart is told
  from the user's (POST /api/kernels/ID/restart), which leases again.

The kernel tells us through a pipe (report.py) whose write end it inherits and keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from jupyter_client.provisioning import LocalProvisioner
from tornado.web import HTTPError

from vaccel.kernel.refusal_log import quiet_refusals
from vaccel.kernel.report import GRANTED, QUEUED, REFUSED, REPORT_FD_VAR, Report
from vaccel.kernel.stopped import STOPPED_VAR

_LAST_WORDS_S = 5.0  # for the reports of a kernel process that has ended to be read


class KernelStartRefused(HTTPError):  # type: ignore[misc]
    """The kernel could not get its lease; the message is the broker's. An HTTPError so
    that jupyter_server hands the message to the front end."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, reason="No device for this kernel")

    def __str__(self) -> str:
        return str(self.log_message)


class VaccelProvisioner(LocalProvisioner):  # type: ignore[misc]
    # One provisioner serves a kernel across its restarts (jupyter_client keeps it).
    lease_ended = ""  # why the kernel's lease ended behind its back: an automatic restart stays without one
    _automatic_restart = False  # set by the restarter's callback, just before it restarts the kernel
    _waiting = False  # the kernel process is in the queue, not yet running IPython
    _relay: asyncio.Task[None] | None = None

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        automatic, self._automatic_restart = self._automatic_restart, False
        self._waiting = False
        await self._hear_last_words()
        env = dict(kwargs.get("env") or os.environ)
        if automatic and self.lease_ended:
            self.log.warning("vaccel kernel %s: restarted without a lease: %s", self.kernel_id, self.lease_ended)
            kwargs["env"] = {**env, STOPPED_VAR: self.lease_ended}
            return await super().launch_kernel(cmd, **kwargs)
        self.lease_ended = ""
        read_fd, write_fd = os.pipe()
        kwargs["env"] = {**env, REPORT_FD_VAR: str(write_fd)}
        kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), write_fd)
        try:
            info = await super().launch_kernel(cmd, **kwargs)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the kernel's copy is the only one: its exit ends the pipe
        self._waiting = True
        started: asyncio.Future[Report | None] = asyncio.get_running_loop().create_future()
        self._relay = asyncio.create_task(self._relay_reports(read_fd, started))
        first = await started
        if first is None or first.kind == REFUSED:
            code = await self._reap()
            quiet_refusals(self.log, KernelStartRefused)  # one log line for it, not two tracebacks
            raise KernelStartRefused(f"no device for this kernel: {first.message}" if first else
                                     f"the vaccel kernel exited (status {code}) before its lease was granted; "
                                     "the server's log has its error")
        return info

    async def _relay_reports(self, read_fd: int, started: asyncio.Future[Report | None]) -> None:
        """Read the kernel's reports until it exits. The first grant, queue message or
        refusal ends the start (`started`); a refusal or an end after it is remembered."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(read_fd, "rb", buffering=0))
        try:
            async for line in reader:
                report = Report.parse(line)
                if report is None:
                    continue
                if report.kind in (QUEUED, GRANTED):
                    self._waiting = report.kind == QUEUED
                    self.log.info("vaccel kernel %s: %s", self.kernel_id, report.message)
                elif started.done():  # lost, or refused after the start: --max-wait ran out
                    self._waiting = False
                    self.lease_ended = (report.message if report.kind != REFUSED else
                                        f"no device for this kernel: {report.message}")
                    self.log.warning("vaccel kernel %s: %s", self.kernel_id, self.lease_ended)
                if not started.done():
                    started.set_result(report)
        finally:
            transport.close()
            if not started.done():
                started.set_result(None)  # the pipe closed without a word: the kernel died starting

    async def _hear_last_words(self) -> None:
        """Before the next start: every report of the previous kernel process, which has
        ended (a restart stops it first), is read, so its lease's end is known."""
        relay, self._relay = self._relay, None
        if relay is None:
            return
        try:
            await asyncio.wait_for(relay, _LAST_WORDS_S)
        except (TimeoutError, asyncio.CancelledError):
            relay.cancel()

    async def post_launch(self, **kwargs: Any) -> None:
        await super().post_launch(**kwargs)
        manager = self.parent
        if manager is not None and hasattr(manager, "add_restart_callback"):
            # The restarter calls this only before a restart of its own, never for the user's.
            manager.remove_restart_callback(self._restarting, "restart")
            manager.add_restart_callback(self._restarting, "restart")

    def _restarting(self) -> None:
        self._automatic_restart = True

    async def shutdown_requested(self, restart: bool = False) -> None:
        """A kernel still in the queue runs no IPython to hear the request: end it now."""
        await super().shutdown_requested(restart=restart)
        if self._waiting:
            await self.terminate(restart=restart)

    async def cleanup(self, restart: bool = False) -> None:
        await super().cleanup(restart=restart)
        if not restart:
            relay, self._relay = self._relay, None
            if relay is not None:
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay
            if self.parent is not None and hasattr(self.parent, "remove_restart_callback"):
                self.parent.remove_restart_callback(self._restarting, "restart")

    async def _reap(self) -> int | None:
        """The exit status of a kernel that is ending by itself (a refusal exits at once)."""
        try:
            return await asyncio.wait_for(self.wait(), timeout=10)
        except TimeoutError:
            await self.kill()
            return await self.wait()
