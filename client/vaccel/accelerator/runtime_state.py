"""Whether a device runtime already started in this process, asked without starting one.

A lease works by setting the visible-devices variables; a device runtime reads them once,
when it initialises. A runtime that started before the lease would ignore them and could
compute on devices someone else holds, so `lease()` asks this module first and refuses.

Nothing here imports torch: when torch is not in `sys.modules`, no runtime can have
started through it, and importing it just to ask would be slow and pointless.
"""

from __future__ import annotations

import sys

# torch's per-runtime modules that keep an "initialised" flag, and the name we report.
# ROCm builds run through torch's cuda module, so "cuda" covers them too.
_RUNTIME_MODULES = ("cuda", "xpu")


def initialised_runtime() -> str | None:
    """The name of a torch device runtime already initialised here ("cuda", "xpu"), or None.

    Never imports torch and never initialises anything: it reads the flags torch keeps
    (`torch.cuda.is_initialized()` and the like). A runtime torch has not flagged as
    initialised (e.g. only `torch.cuda.is_available()` was called) is not detected; the
    accelerator's device-count check against the lease catches that case later.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    for name in _RUNTIME_MODULES:
        # The per-runtime modules are imported by `import torch`; a half-imported torch
        # (this called from inside its own import) simply lacks them.
        module = getattr(torch, name, None)
        is_initialized = getattr(module, "is_initialized", None)
        if is_initialized is not None and is_initialized():
            return name
    return None

