"""`vaccel kernel install`: the kernelspec of the vaccel kernel, written where Jupyter
looks for kernels: yours (--user), this Python environment's (--sys-prefix) or, with
neither, the system's (e.g. /usr/local/share/jupyter/kernels: every user's JupyterHub
server sees it; needs root).

The kernelspec runs this very interpreter (the one with vaccel and ipykernel), and names
the vaccel provisioner so the server shows the queue and a refusal (provisioner.py).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

PROVISIONER = "vaccel-provisioner"  # the entry point's name in pyproject.toml


def default_name(gpus: int) -> str:
    return f"vaccel-{gpus}gpu"


def display_name(gpus: int, on_busy: str = "wait", max_wait: str | None = None) -> str:
    """The name Jupyter's launcher shows; kernels that act differently when the devices are
    busy are told apart there (two kernels of one name, one failing at once, confuse)."""
    how = ", fails at once when busy" if on_busy == "fail" else f", waits up to {max_wait}" if max_wait else ""
    return f"Python 3 (vaccel, {gpus} GPU{'s' if gpus > 1 else ''}{how})"


def kernel_spec(*, gpus: int, on_busy: str, max_wait: str | None, socket: str | None, display: str,
                provisioner: bool, python: str = sys.executable) -> dict[str, Any]:
    """The kernel.json contents. The options are the kernel's own arguments, so the file
    says in one place what the kernel does (an admin may edit them there)."""
    argv = [python, "-m", "vaccel.kernel", "-f", "{connection_file}", "--gpus", str(gpus), "--on-busy", on_busy]
    if max_wait:
        argv += ["--max-wait", max_wait]
    if socket:
        argv += ["--socket", socket]
    spec: dict[str, Any] = {
        "argv": argv,
        "display_name": display,
        "language": "python",
        "interrupt_mode": "signal",  # SIGINT: what the kernel's IPython expects
        "metadata": {},
    }
    if provisioner:
        spec["metadata"]["kernel_provisioner"] = {"provisioner_name": PROVISIONER}
    return spec


def name_problem(name: str) -> str:
    """Why `name` cannot be a kernel name ("" when it can): it names a folder, so Jupyter
    allows ASCII letters, digits, '-', '.' and '_' only, and "." or ".." would be no folder."""
    bad = sorted({c for c in name if not (c.isascii() and (c.isalnum() or c in "-._"))})
    if bad:
        return f"{' '.join(repr(c) for c in bad)} cannot be in a kernel name (ASCII letters, digits, '-', '.', '_')"
    if name in ("", ".", ".."):
        return "a kernel name names a folder: give letters or digits"
    return ""


def missing_packages() -> list[str]:
    return [name for name in ("ipykernel", "jupyter_client") if importlib.util.find_spec(name) is None]


def install(name: str, spec: dict[str, Any], *, user: bool, sys_prefix: bool) -> str:
    """Write the kernelspec; return the folder it went to. PermissionError where the
    caller may not write (the system's folder without root)."""
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory(prefix="vaccel-kernelspec-") as tmp:
        folder = Path(tmp) / "kernelspec"  # not `name`: a name like ../x must not place it outside tmp
        folder.mkdir()
        (folder / "kernel.json").write_text(json.dumps(spec, indent=1) + "\n")
        _copy_logos(folder)
        return KernelSpecManager().install_kernel_spec(
            str(folder), kernel_name=name, user=user, prefix=sys.prefix if sys_prefix else None)


def _copy_logos(folder: Path) -> None:
    """IPython's logos, so the launcher shows the usual Python icon."""
    try:
        from ipykernel.kernelspec import RESOURCES
    except ImportError:
        return
    for logo in Path(RESOURCES).glob("logo-*.png"):
        shutil.copy(logo, folder / logo.name)
