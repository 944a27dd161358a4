"""The mixed-precision policy: which autocast dtype, and whether gradients are scaled.

It comes from, in order: the `amp=` argument, the `amp_config` of the accelerator-config
file the lease names in VACCEL_ACCELERATOR_CONFIG, else full precision. The daemon has
validated the file; here we only read it: `dtype` is autocast's dtype, `grad_scaler:
false` turns the float16 GradScaler off, and `backend` must be `native` (torch.amp).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

CONFIG_ENV = "VACCEL_ACCELERATOR_CONFIG"

# Accepted spellings -> canonical torch dtype name; None means full precision.
_DTYPES: dict[str, str | None] = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "none": None,
    "no": None,
    "fp32": None,
    "float32": None,
}


@dataclass(frozen=True)
class AmpPolicy:
    """`dtype` is "float16", "bfloat16" or None (full precision). Gradients are scaled
    only for float16: bfloat16 has float32's exponent range and does not underflow."""

    dtype: str | None = None
    grad_scaler: bool = False

    @property
    def enabled(self) -> bool:
        return self.dtype is not None


def parse_dtype(value: str) -> str | None:
    """The canonical dtype name for a user's spelling, or ValueError naming the choices."""
    key = value.strip().lower()
    if key not in _DTYPES:
        raise ValueError(
            f"unknown AMP dtype {value!r}; use float16, bfloat16 or none"
        )
    return _DTYPES[key]


def policy_from(amp: str | None, env: Mapping[str, str]) -> AmpPolicy:
    """The policy for an accelerator given its `amp=` argument and the lease's environment."""
    if amp is not None:
        dtype = parse_dtype(amp)
        return AmpPolicy(dtype=dtype, grad_scaler=dtype == "float16")
    path = env.get(CONFIG_ENV)
    if not path:
        return AmpPolicy()
    return _policy_from_file(Path(path))


def _policy_from_file(path: Path) -> AmpPolicy:
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ValueError(f"cannot read accelerator config {path} ({CONFIG_ENV}): {err}") from err
    amp_config = (document or {}).get("amp_config") or {}
    backend = str(amp_config.get("backend", "native")).lower()
    if backend != "native":
        # The daemon refuses such a file; a config read without it must not be half-applied.
        raise ValueError(f"{path}: amp_config.backend {backend!r} is not supported; use native "
                         "(torch.amp autocast and GradScaler)")
    raw_dtype = amp_config.get("dtype", "none")
    dtype = parse_dtype("none" if raw_dtype is None else str(raw_dtype))
    # A config may turn the scaler off for float16 (e.g. a loss known to be well scaled);
    # it cannot turn it on for bfloat16 or full precision, where it would do nothing useful.
    grad_scaler = dtype == "float16" and bool(amp_config.get("grad_scaler", True))
    return AmpPolicy(dtype=dtype, grad_scaler=grad_scaler)
