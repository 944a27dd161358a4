"""Facts about this Python environment that only the client knows, sent with every
lease request and `vaccel check` so the daemon can check the runtime contract:
the torch version and build, the architectures it carries kernels for, torch.distributed,
and the versions of the packages the contract names.

Gathering never initialises a device runtime, and imports torch only when installed.

Test hook: `VACCEL_FAKE_TORCH_ARCHS` (a comma-separated list of the arch names torch
reports) replaces the architecture list of the installed build (the backend follows the
names, as vaccel.accelerator.introspect reads them; `VACCEL_FAKE_TORCH_BACKEND` sets it
explicitly). It exists so the kernel-image
checks can be tested on a machine without the matching GPU build of torch.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Iterable

from vaccel.accelerator.introspect import inspect_torch_build, with_fake_archs
from vaccel_common.v1 import broker_pb2

FAKE_ARCHS_ENV = "VACCEL_FAKE_TORCH_ARCHS"
FAKE_BACKEND_ENV = "VACCEL_FAKE_TORCH_BACKEND"
_TORCH_NAMES = ("pytorch", "torch")


def gather_facts(
    packages: Iterable[str] = (), *, inspect_torch: bool = True
) -> broker_pb2.ClientFacts:
    """This environment's facts. `packages` are the dependency names a contract lists
    (their installed versions are included; missing ones are left out). With
    `inspect_torch=False` torch is not looked at (no import cost, no torch facts)."""
    facts = broker_pb2.ClientFacts(python_version=platform.python_version(), python_executable=sys.executable)
    build = inspect_torch_build() if inspect_torch else None
    fake = os.environ.get(FAKE_ARCHS_ENV, "")
    if fake:
        archs = [a.strip() for a in fake.split(",") if a.strip()]
        build = with_fake_archs(build, archs, os.environ.get(FAKE_BACKEND_ENV, ""))
    if build is not None:
        facts.torch_version = build.version
        facts.torch_backend = build.backend
        facts.torch_runtime_version = build.runtime_version
        facts.kernel_archs.extend(build.kernel_archs)
        facts.ptx_archs.extend(build.ptx_archs)
        facts.distributed_available = build.distributed_available
        facts.distributed_backends.extend(build.distributed_backends)
    for name in dict.fromkeys(packages):
        version = _installed_version(name, build.version if build else "")
        if version:
            facts.packages[name] = version
    return facts


def _installed_version(name: str, torch_version: str) -> str:
    if name.lower() in _TORCH_NAMES and torch_version:
        return torch_version
    dist_name = "torch" if name.lower() in _TORCH_NAMES else name
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return ""
