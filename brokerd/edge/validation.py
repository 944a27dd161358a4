"""What the edge refuses before the core sees a request: absurd numbers, oversized texts,
unknown choices. One short line each, as the client's INVALID_ARGUMENT."""

from __future__ import annotations

import math

from brokerd.state.report import BY as REPORT_BY
from vaccel_common.v1 import broker_pb2 as pb

MAX_GPUS = 1024
MAX_MEMORY_MIB = 1 << 40  # 1 EiB: anything above is a typo, not a GPU
MAX_WAIT_S = 366 * 86400
MAX_TIME_LIMIT_S = 366 * 86400  # the policy's time_max refuses far less; this catches typos early
MAX_TEXT = 256 * 1024  # contract files and config: plenty for YAML a human writes


def acquire_problem(request: pb.AcquireRequest) -> str:
    """Why an Acquire or TryAcquire request cannot be taken, "" when it can."""
    if request.gpus < 1:
        return "gpus must be at least 1"
    if request.gpus > MAX_GPUS:
        return f"gpus={request.gpus} is absurd: at most {MAX_GPUS}"
    if request.min_memory_mib < 0:
        return "min_memory must not be negative"
    if request.min_memory_mib > MAX_MEMORY_MIB:
        return f"min_memory={request.min_memory_mib} MiB is absurd"
    if not 0 <= request.memory_mib <= MAX_MEMORY_MIB:
        return f"a memory share of {request.memory_mib} MiB is absurd"
    wait = request.max_wait_seconds
    if math.isnan(wait) or wait < 0 or wait > MAX_WAIT_S:
        return f"wait must be between 0 and {MAX_WAIT_S} seconds (or forever), got {wait}"
    if len(request.runtime_spec_yaml) > MAX_TEXT or len(request.accelerator_config_yaml) > MAX_TEXT:
        return "contract file larger than 256 KiB"
    limit = request.time_limit_s
    if math.isnan(limit) or limit < 0 or limit > MAX_TIME_LIMIT_S:
        return (f"a time limit must be more than 0 and at most {MAX_TIME_LIMIT_S / 86400:.0f} days, "
                f"got {limit:g} seconds")
    if len(request.devices) > MAX_GPUS or any(len(d) > 128 for d in request.devices):
        return "too many or too long device names"
    return ""


def check_problem(request: pb.CheckRequest) -> str:
    """Why a Check request cannot be taken, "" when it can."""
    if len(request.runtime_spec_yaml) > MAX_TEXT or len(request.accelerator_config_yaml) > MAX_TEXT:
        return "contract file larger than 256 KiB"
    return ""


def release_problem(request: pb.ReleaseRequest) -> str:
    """Why a Release request cannot be taken, "" when it can."""
    if not 0 <= request.grace_s <= MAX_WAIT_S:
        return f"grace must be between 0 and {MAX_WAIT_S:.0f} seconds, got {request.grace_s}"
    return ""


def attach_problem(request: pb.AttachContainerRequest) -> str:
    """Why an AttachContainer request cannot be taken, "" when it can."""
    if not request.container_id and not request.init_pid:
        return "name the container: its id, or for a rootless engine its init's pid"
    if len(request.container_id) > 128 or len(request.name) > 256 or len(request.image) > 1024:
        return "container id, name or image too long"
    return ""


def report_problem(request: pb.ReportRequest) -> str:
    """Why a Report request cannot be taken, "" when it can."""
    if request.by not in ("", *REPORT_BY):
        return f"by must be one of {', '.join(REPORT_BY)}, got {request.by[:40]!r}"
    if not all(math.isfinite(t) and 0 <= t < 1e11 for t in (request.since, request.until)):
        return "since and until must be Unix times (0: the default)"
    if request.since and request.until and request.since >= request.until:
        return "since must come before until"
    return ""
