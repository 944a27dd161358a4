"""The Jupyter server's side of the vaccel kernel (entry point `vaccel-provisioner` in
`jupyter_client.kernel_provisioners`): the local provisioner, plus a start that lasts
until the kernel process holds its lease.

The lease itself is the kernel process's (see __main__.py): the server never holds one,
so a kernel that dies frees its devices whatever happens to the server. What this adds:

- while the kernel waits in the queue, each new queue message goes to the server's log,
  where Jupyter logs kernel start-up, and the start stays pending (JupyterLab shows the
  kernel as starting);
- when the broker refuses (no device free and the kernelspec says `--on-busy fail`, or
  `--max-wait` ran out) the start fails with the broker's message, which the server hands
  to the frontend as the reason, instead of a kernel that died for no visible reason.

The kernel tells us through a pipe (report.py) whose write end it inherits.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from jupyter_client.provisioning import LocalProvisioner

from vaccel.kernel.report import GRANTED, QUEUED, REFUSED, REPORT_FD_VAR, Report


class KernelStartRefused(RuntimeError):
    """The broker refused the kernel's lease; the message is the broker's."""


class VaccelProvisioner(LocalProvisioner):  # type: ignore[misc]
    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        read_fd, write_fd = os.pipe()
        env = dict(kwargs.get("env") or os.environ)
        env[REPORT_FD_VAR] = str(write_fd)
        kwargs["env"] = env
        kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), write_fd)
        try:
            info = await super().launch_kernel(cmd, **kwargs)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the kernel's copy is the only one: its exit ends the pipe
        await self._until_leased(read_fd)
        return info

    async def _until_leased(self, read_fd: int) -> None:
        """Relay the kernel's reports until the grant; raise when it is refused or dies first."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                    os.fdopen(read_fd, "rb", buffering=0))
        last = ""
        try:
            async for line in reader:
                report = Report.parse(line)
                if report is None:
                    continue
                if report.kind == QUEUED:
                    last = report.message
                    self.log.info("vaccel kernel %s: %s", self.kernel_id, report.message)
                elif report.kind == GRANTED:
                    self.log.info("vaccel kernel %s: %s", self.kernel_id, report.message)
                    return
                elif report.kind == REFUSED:
                    await self._reap()
                    raise KernelStartRefused(f"no device for this kernel: {report.message}")
        finally:
            transport.close()
        # The pipe closed without a word: the kernel died while starting (or was killed).
        code = await self._reap()
        raise KernelStartRefused(f"the vaccel kernel exited (status {code}) before its lease was granted"
                                 + (f"; last queue message: {last}" if last else "")
                                 + "; the server's log has its error")

    async def _reap(self) -> int | None:
        """The exit status of a kernel that is ending by itself (a refusal exits at once)."""
        try:
            return await asyncio.wait_for(self.wait(), timeout=10)
        except TimeoutError:
            await self.kill()
            return await self.wait()
