"""What `vaccel-brokerd --probe [--json]` prints: the inventory and each probe's verdict."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from brokerd.devices.model import Device, GpuProcess, Snapshot


def _json_safe(value: Any) -> Any:
    """Device.extra may hold anything a probe found; JSON gets plain values."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def device_dict(device: Device) -> dict[str, Any]:
    """Every Device field, `extra` made JSON-safe."""
    out = asdict(device)
    out["extra"] = _json_safe(device.extra)
    out["visible_id"] = device.visible
    out["device_nodes"] = list(device.device_nodes)
    return out


def process_dict(proc: GpuProcess) -> dict[str, Any]:
    return asdict(proc)


def probe_report(snapshot: Snapshot) -> dict[str, Any]:
    """`{"devices": [...], "probes": [{"vendor", "available", "reason"}], "processes":
    [...], "simulated": bool}`; devices carry at least index, uuid, vendor, name,
    memory_mib."""
    return {
        "devices": [device_dict(d) for d in snapshot.devices],
        "probes": [
            {"vendor": v.vendor, "available": v.available, "reason": v.reason}
            for v in snapshot.verdicts
        ],
        "processes": [process_dict(p) for p in snapshot.processes],
        "simulated": snapshot.simulated,
    }


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]]


def _memory(device: Device) -> str:
    if not device.memory_mib:
        return "?"
    return f"{device.memory_used_mib}/{device.memory_mib} MiB"


def render_probe_text(snapshot: Snapshot) -> str:
    """A readable table of devices, then each probe's verdict, then GPU processes."""
    lines: list[str] = []
    if snapshot.devices:
        rows = [
            [
                d.label.removeprefix("gpu"), d.vendor, d.name, _memory(d), d.arch or "?",
                d.driver_version or "?",
                f"{d.memory_bandwidth_gbps:g} GB/s" if d.memory_bandwidth_gbps else "?",
                "ok" if d.healthy else f"UNHEALTHY: {d.health_reason}",
                d.uuid,
            ]
            for d in snapshot.devices
        ]
        header = ["IDX", "VENDOR", "NAME", "MEMORY", "ARCH", "DRIVER", "BANDWIDTH",
                  "HEALTH", "UUID"]
        lines += _table(header, rows)
        # What `[enforce] mode = "acl"` gates; a device without one is never granted then.
        lines.append("")
        lines.append("Device nodes:")
        lines += [f"  {d.label.removeprefix('gpu'):<3} {', '.join(d.device_nodes) or 'none found'}"
                  for d in snapshot.devices]
    else:
        lines.append("No devices found.")
    if snapshot.simulated:
        lines.append("(simulated inventory: these devices do not exist)")
    lines.append("")
    lines.append("Probes:")
    for v in snapshot.verdicts:
        state = "found" if v.available else "none"
        lines.append(f"  {v.vendor:<9} {state:<5}  {v.reason}")
    if snapshot.processes:
        lines.append("")
        lines.append("GPU processes:")
        rows = [
            [str(p.pid), p.user or "?", f"{p.used_memory_mib} MiB", p.device_uuid,
             p.command or "?"]
            for p in snapshot.processes
        ]
        lines += ["  " + line for line in
                  _table(["PID", "USER", "MEMORY", "DEVICE", "COMMAND"], rows)]
    return "\n".join(lines) + "\n"
