"""The kernel Jupyter's automatic restart brings back after the lease ended behind the
kernel's back (an admin's revoke, its time limit, idle reclaim): a Python kernel that
holds no lease and runs no code, whose every cell fails with why the lease ended and what
to do. Only the user's own restart (the provisioner tells one from the other) asks for a
new lease, so a revoke or a time limit ends a notebook's use of the devices for good.

Jupyter would otherwise restart the dead kernel within seconds and, through a fresh
lease, take the devices back with nobody asking, again and again. Failing the restart
instead would make the restarter retry at every poll. A kernel that is up and says why is
also what the notebook's user sees best: the next cell they run tells them.
"""

from __future__ import annotations

import sys
from typing import Any

STOPPED_VAR = "VACCEL_KERNEL_STOPPED"  # the reason, set by the provisioner for an automatic restart
ERROR_NAME = "LeaseEnded"


def message(reason: str) -> str:
    return (f"{reason}. This kernel holds no device and runs no code until you restart it "
            "(Kernel > Restart Kernel), which asks for a new lease.")


def run_stopped_kernel(connection_file: str, kernel_args: list[str], reason: str) -> None:
    """IPython's kernel, refusing every execution with `reason`; returns when it shuts down."""
    from ipykernel.ipkernel import IPythonKernel
    from ipykernel.kernelapp import IPKernelApp

    said = message(reason)

    class StoppedKernel(IPythonKernel):  # type: ignore[misc]
        async def do_execute(self, code: str, silent: bool, *args: Any, **kwargs: Any) -> dict[str, Any]:
            content = {"ename": ERROR_NAME, "evalue": said, "traceback": [f"{ERROR_NAME}: {said}"]}
            if not silent:
                self.send_response(self.iopub_socket, "error", content)
            return {"status": "error", "execution_count": self.shell.execution_count, **content}

    print(f"vaccel: {said}", file=sys.stderr, flush=True)  # the server's log
    app = IPKernelApp.instance(kernel_class=StoppedKernel)
    app.initialize(["-f", connection_file, *kernel_args])
    app.start()
