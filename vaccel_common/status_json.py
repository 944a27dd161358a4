"""The JSON shape of a status reply, shared so that `vaccel status --json` (the client) and
the dashboard's `/api/status` (the daemon) can never drift apart: both hand the same
pb.StatusReply to `status_json`.
"""

from __future__ import annotations

from typing import Any

from vaccel_common.v1 import broker_pb2 as pb

# protobuf's JSON mapping writes int64 as strings; scripts want numbers.
_INT64_FIELDS = {"memory_mib", "memory_used_mib", "min_memory_mib", "used_memory_mib", "memory_cap_mib", "used_mib",
                 "share_mib"}


def _ints(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: int(v) if k in _INT64_FIELDS and isinstance(v, str) else _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


def message_dict(msg: Any) -> dict[str, Any]:
    """A message as JSON-ready data: proto field names, every field present, int64 as numbers."""
    from google.protobuf.json_format import MessageToDict  # ~20 ms of imports: only when JSON is wanted

    return _ints(MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))


def status_json(reply: pb.StatusReply) -> dict[str, Any]:
    """The DESIGN.md shape: devices with state and holder, the queue, unleased processes.
    Each device says how it is leased, `"sharing": "exclusive" | "memory" | "mig"`, and
    lists its memory shares as `"shares": [{"lease_id", "user", "memory_mib", "used_mib"}]`
    (docs/sharing.md)."""
    devices = []
    for d in reply.devices:
        item = message_dict(d)
        item["holder"] = ({"user": d.holder.user, "uid": d.holder.uid, "pid": d.holder.pid,
                           "command": d.holder.command} if d.lease_id else None)
        item["lease_id"] = d.lease_id or None
        item["since"] = d.since or None
        item["sharing"] = d.sharing or "exclusive"
        item["label"] = d.label or f"gpu{d.index}"
        devices.append(item)
    return {
        "hostname": reply.hostname,
        "version": reply.version,
        "simulated": reply.simulated,
        "enforcement": reply.enforcement or "off",
        "slurm_mode": reply.slurm_mode or "off",
        "devices": devices,
        "queue": [message_dict(q) for q in reply.queue],
        "unleased_processes": [message_dict(p) for p in reply.unleased_processes],
        "probes": [message_dict(p) for p in reply.probes],
        "usage": [message_dict(u) for u in reply.usage],
    }
