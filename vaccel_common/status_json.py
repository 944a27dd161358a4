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


def _in_field_order(msg: Any, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with its keys in the message's field order, an unset message field as None.
    MessageToDict puts the fields that are set first and the defaults after (and leaves out
    an unset message), so two devices' keys came in different orders."""
    from google.protobuf.message import Message

    ordered: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        kind = field.message_type
        if field.name not in data:
            if kind is not None and isinstance(getattr(msg, field.name), Message):  # singular, not repeated
                ordered[field.name] = None
            continue
        value = data[field.name]
        if kind is not None and not kind.GetOptions().map_entry:
            inner = getattr(msg, field.name)
            value = ([_in_field_order(m, v) for m, v in zip(inner, value, strict=True)]
                     if isinstance(value, list) else _in_field_order(inner, value))
        ordered[field.name] = value
    return ordered


def message_dict(msg: Any) -> dict[str, Any]:
    """A message as JSON-ready data: proto field names, every field present and in the
    message's field order, int64 as numbers."""
    from google.protobuf.json_format import MessageToDict  # ~20 ms of imports: only when JSON is wanted

    data = MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _ints(_in_field_order(msg, data))


def holder_json(holder: pb.Holder) -> dict[str, Any]:
    """Who holds a lease; `container` the container it is applied to (`vaccel run -- docker
    run`), None when none."""
    container = holder.container if holder.HasField("container") else None
    return {"user": holder.user, "uid": holder.uid, "pid": holder.pid, "command": holder.command,
            "container": {"id": container.id, "name": container.name, "image": container.image,
                          "engine": container.engine} if container is not None else None}


def status_json(reply: pb.StatusReply) -> dict[str, Any]:
    """The DESIGN.md shape: devices with state and holder, the queue, unleased processes.
    Each device says how it is leased, `"sharing": "exclusive" | "memory" | "mig"`, and
    lists its memory shares as `"shares": [{"lease_id", "user", "memory_mib", "used_mib"}]`
    (docs/sharing.md)."""
    devices = []
    for d in reply.devices:
        item = message_dict(d)
        item["holder"] = holder_json(d.holder) if d.lease_id else None
        item["lease_id"] = d.lease_id or None
        item["since"] = d.since or None
        item["utilization"] = d.utilization if d.utilization >= 0 else None  # null: not measured (simulated, CPU)
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
        "stopped_containers": [message_dict(c) for c in reply.stopped_containers],
    }
