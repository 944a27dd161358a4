"""What the installed torch build targets, read without starting a device runtime.

Everything here reads compile-time facts (version strings, the architecture list the
build was compiled with, which collective libraries were linked). Nothing calls a
device-count or availability function, because those initialise the runtime and would
pin devices before a lease has set the visible-devices variables.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, replace

# torch.distributed's availability probes, by backend name; all are compile-time flags.
_DIST_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl")


@dataclass(frozen=True)
class TorchBuild:
    version: str
    backend: str  # cuda | rocm | xpu, or "" for a CPU-only build
    runtime_version: str  # the device runtime the build was compiled against
    kernel_archs: tuple[str, ...]  # sm_80, gfx90a, pvc: compiled machine code
    ptx_archs: tuple[str, ...]  # compute_90: PTX the driver can JIT from
    distributed_available: bool
    distributed_backends: tuple[str, ...]


def torch_installed() -> bool:
    """True when torch is importable; finding out imports nothing."""
    return "torch" in sys.modules or importlib.util.find_spec("torch") is not None


def inspect_torch_build() -> TorchBuild | None:
    """The installed torch build, or None when torch is not installed."""
    if not torch_installed():
        return None
    import torch

    version_info = torch.version
    backend, runtime, flags = "", "", None
    if getattr(version_info, "hip", None):
        backend, runtime = "rocm", version_info.hip
        flags = _call(getattr(torch._C, "_cuda_getArchFlags", None))
    elif getattr(version_info, "cuda", None):
        backend, runtime = "cuda", version_info.cuda
        flags = _call(getattr(torch._C, "_cuda_getArchFlags", None))
    elif getattr(version_info, "xpu", None) or _xpu_compiled(torch):
        backend, runtime = "xpu", str(getattr(version_info, "xpu", "") or "")
        flags = _call(getattr(torch._C, "_xpu_getArchFlags", None))
    kernels, ptx = split_arch_list(re.split(r"[\s,;]+", flags or ""))
    dist_available, dist_backends = _distributed(torch)
    return TorchBuild(
        version=str(torch.__version__),
        backend=backend,
        runtime_version=str(runtime or ""),
        kernel_archs=kernels,
        ptx_archs=ptx,
        distributed_available=dist_available,
        distributed_backends=dist_backends,
    )


def _call(fn: object) -> str | None:
    return fn() if callable(fn) else None


def _xpu_compiled(torch: object) -> bool:
    xpu = getattr(torch, "xpu", None)
    compiled = getattr(xpu, "_is_compiled", None)
    return bool(compiled()) if callable(compiled) else False


def _distributed(torch: object) -> tuple[bool, tuple[str, ...]]:
    import torch.distributed as dist

    if not dist.is_available():
        return False, ()
    found = tuple(name for name in _DIST_BACKENDS
                  if callable(probe := getattr(dist, f"is_{name}_available", None)) and probe())
    return True, found


def split_arch_list(archs: list[str] | tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split torch's arch list into compiled kernels and PTX (compute_XY) entries."""
    names = [a.strip() for a in archs if a.strip()]
    ptx = tuple(a for a in names if a.startswith("compute_"))
    return tuple(a for a in names if not a.startswith("compute_")), ptx


def backend_for_archs(archs: list[str] | tuple[str, ...]) -> str:
    """The backend an arch list belongs to: sm_/compute_ are cuda, gfx rocm, else xpu."""
    first = next((a for a in archs if a), "")
    if first.startswith(("sm_", "compute_")):
        return "cuda"
    if first.startswith("gfx"):
        return "rocm"
    return "xpu" if first else ""


def with_fake_archs(build: TorchBuild | None, archs: list[str], backend: str = "") -> TorchBuild:
    """`build` as if compiled for `archs` (the VACCEL_FAKE_TORCH_ARCHS test hook); the
    backend follows the arch names unless `backend` is given."""
    kernels, ptx = split_arch_list(archs)
    base = build or TorchBuild("0.0.0+fake", "", "", (), (), False, ())
    return replace(base, backend=backend or backend_for_archs(archs) or base.backend,
                   kernel_archs=kernels, ptx_archs=ptx)
