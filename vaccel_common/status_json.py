"""The JSON shape of a status reply, shared so that `vaccel status --json` (the client) and
the dashboard's `/api/status` (the daemon) can never drift apart: both hand the same
pb.StatusReply to `status_json`.
"""

from __future__ import annotations

from typing import Any

from vaccel_common.v1 import broker_pb2 as pb

# protobuf's JSON mapping writes int64 as strings; scripts want numbers.
_INT64_FIELDS = {"memory_mib", "memory_used_mib", "min_memory_mib", "used_memory_mib", "memory_cap_mib"}


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


def holder_json(holder: pb.Holder) -> dict[str, Any]:
    """Who holds a lease; `container` the container it is applied to (`vaccel run -- docker
    run`), None when none."""
    container = holder.container if holder.HasField("container") else None
    return {"user": holder.user, "uid": holder.uid, "pid": holder.pid, "command": holder.command,
            "container": {"id": container.id, "name": container.name, "image": container.image,
                          "engine": container.engine} if container is not None else None}


def status_json(reply: pb.StatusReply) -> dict[str, Any]:
    """The DESIGN.md shape: devices with state and holder, the queue, unleased processes."""
    devices = []
    for d in reply.devices:
        item = message_dict(d)
        item["holder"] = holder_json(d.holder) if d.lease_id else None
        item["lease_id"] = d.lease_id or None
        item["since"] = d.since or None
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
