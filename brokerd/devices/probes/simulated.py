"""Simulated devices from an inventory YAML file (tests, demos, CI). Never used silently:
only `--inventory FILE` selects it.

    devices:
      - vendor: nvidia
        name: NVIDIA A100-SXM4-80GB
        uuid: GPU-6f1a0c2e-0000-0000-0000-000000000001
        pci_bus_id: "0000:07:00.0"
        memory_mib: 81920
        compute_capability: "8.0"     # amd: gfx_target: gfx90a; intel: arch: Xe_HPG
        driver_version: "535.54.03"
        memory_bandwidth_gbps: 2039
        device_nodes: [/dev/nvidia0]  # optional: the nodes `[enforce] mode = "acl"` gates
        usage_file: /run/usage.json   # optional: {"PID": MiB} read at each probe, the memory
                                      # each process uses on it (as NVML reads it per process)
        mig:                          # optional: the GPU is in MIG mode; these instances are
          - profile: 1g.18gb          # its leasable devices (gpu0.0, gpu0.1, ...); each may
            uuid: MIG-6f1a0c2e-0001   # name its own device_nodes (after the GPU's) and usage_file
            memory_mib: 16384
    processes:                        # optional: GPU processes the probe "sees"
      - device_uuid: GPU-6f1a0c2e-0000-0000-0000-000000000001
        pid: 12345
        used_memory_mib: 1024
        user: bob                     # optional, shown when /proc has no such pid
        command: python3 train.py     # optional
"""

from __future__ import annotations

import difflib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from brokerd.devices.model import Device, GpuProcess, ProbeResult, ProbeVerdict

# Vendor -> (torch backend, the key that carries its architecture).
_VENDORS: dict[str, tuple[str, str]] = {
    "nvidia": ("cuda", "compute_capability"),
    "amd": ("rocm", "gfx_target"),
    "intel": ("xpu", "arch"),
    "cpu": ("cpu", "arch"),
}
_KNOWN_KEYS = {
    "vendor", "name", "uuid", "pci_bus_id", "memory_mib", "compute_capability", "gfx_target",
    "arch", "driver_version", "memory_bandwidth_gbps", "numa_node", "interconnect_group",
    "healthy", "health_reason", "memory_used_mib", "runtime_version", "device_nodes", "usage_file", "mig",
}
_MIG_KEYS = {"profile", "uuid", "memory_mib", "device_nodes", "usage_file"}


class InventoryError(ValueError):
    """The inventory file cannot be used; the message names the file and the entry."""


def normalise_arch(vendor: str, raw: str) -> str:
    """sm_80 for NVIDIA's "8.0"; AMD and Intel names are already canonical."""
    raw = str(raw).strip()
    if vendor == "nvidia" and raw and not raw.startswith("sm_"):
        major, _, minor = raw.partition(".")
        return f"sm_{major}{minor or '0'}"
    return raw


def _nodes(entry: dict[str, Any], where: str) -> tuple[str, ...]:
    nodes = entry.get("device_nodes") or []
    if not isinstance(nodes, list) or not all(isinstance(n, str) and n.startswith("/") for n in nodes):
        raise InventoryError(f"{where}: device_nodes must be a list of absolute paths, got {nodes!r}")
    return tuple(nodes)


def read_usage(entry: dict[str, Any], where: str) -> dict[int, int]:
    """The entry's usage_file, {"PID": MiB}, as pid -> MiB; none while the file is absent."""
    path = entry.get("usage_file")
    if not path:
        return {}
    try:
        raw = json.loads(Path(str(path)).read_text() or "{}")
        return {int(pid): int(mib) for pid, mib in raw.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise InventoryError(f"{where}: usage_file {path}: expected {{\"PID\": MiB, ...}}: {exc}") from exc


def _instances(parent: Device, listed: Any, where: str) -> tuple[Device, ...]:
    """A GPU in MIG mode as its instances: each a device of its own, with the GPU's facts."""
    if not isinstance(listed, list) or not listed:
        raise InventoryError(f"{where}: mig must be a non-empty list of instances")
    instances = []
    for n, item in enumerate(listed):
        at = f"{where}.mig[{n}]"
        if not isinstance(item, dict) or not {"profile", "uuid", "memory_mib"} <= set(item) \
                or set(item) - _MIG_KEYS:
            raise InventoryError(f"{at}: expected profile, uuid, memory_mib (device_nodes, usage_file optional)")
        try:
            memory = int(item["memory_mib"])
        except (TypeError, ValueError) as exc:
            raise InventoryError(f"{at}: {exc}") from exc
        if not 0 < memory <= parent.memory_mib:
            raise InventoryError(f"{at}: memory_mib must be positive and at most the GPU's {parent.memory_mib}")
        profile = str(item["profile"])
        used = sum(read_usage(item, at).values())
        instances.append(replace(
            parent, uuid=str(item["uuid"]), name=f"{parent.name} MIG {profile}", memory_mib=memory,
            memory_used_mib=used, mig_index=n, parent_uuid=parent.uuid, mig_profile=profile,
            device_nodes=parent.device_nodes + _nodes(item, at)))
    return tuple(instances)


def _device(entry: Any, index: int, source: str) -> tuple[Device, ...]:
    """The entry's device, or its MIG instances."""
    where = f"{source}: devices[{index}]"
    if not isinstance(entry, dict):
        raise InventoryError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - _KNOWN_KEYS)
    if unknown:
        raise InventoryError(f"{where}: unknown key(s) {', '.join(unknown)}")
    vendor = str(entry.get("vendor", "")).lower()
    if vendor not in _VENDORS:
        known = ", ".join(_VENDORS)
        raise InventoryError(f"{where}: vendor must be one of {known}, got {vendor!r}")
    backend, arch_key = _VENDORS[vendor]
    for key in ("name", "uuid", "memory_mib"):
        if key not in entry:
            raise InventoryError(f"{where}: missing required key {key!r}")
    try:
        memory = int(entry["memory_mib"])
        bandwidth = float(entry.get("memory_bandwidth_gbps", 0) or 0)
        used = int(entry.get("memory_used_mib", 0) or 0)
        numa = int(entry.get("numa_node", -1))
    except (TypeError, ValueError) as exc:
        raise InventoryError(f"{where}: {exc}") from exc
    if memory <= 0:
        raise InventoryError(f"{where}: memory_mib must be positive, got {memory}")
    raw_arch = str(entry.get(arch_key, "") or "")
    device = Device(
        index=index,
        uuid=str(entry["uuid"]),
        vendor=vendor,
        name=str(entry["name"]),
        memory_mib=memory,
        backend=backend,
        arch=normalise_arch(vendor, raw_arch),
        compute_capability=raw_arch,
        pci_bus_id=str(entry.get("pci_bus_id", "")),
        driver_version=str(entry.get("driver_version", "")),
        runtime_version=str(entry.get("runtime_version", "")),
        memory_bandwidth_gbps=bandwidth,
        memory_used_mib=max(used, sum(read_usage(entry, where).values())),
        numa_node=numa,
        interconnect_group=str(entry.get("interconnect_group", "")),
        healthy=bool(entry.get("healthy", True)),
        health_reason=str(entry.get("health_reason", "")),
        simulated=True,
        device_nodes=_nodes(entry, where),
    )
    return _instances(device, entry["mig"], where) if "mig" in entry else (device,)


_PROCESS_KEYS = {"device_uuid", "pid", "used_memory_mib", "user", "uid", "command"}


def _process(entry: Any, index: int, source: str, uuids: set[str]) -> GpuProcess:
    where = f"{source}: processes[{index}]"
    if not isinstance(entry, dict):
        raise InventoryError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - _PROCESS_KEYS)
    if unknown:
        raise InventoryError(f"{where}: unknown key(s) {', '.join(unknown)}")
    for key in ("device_uuid", "pid"):
        if key not in entry:
            raise InventoryError(f"{where}: missing required key {key!r}")
    if str(entry["device_uuid"]) not in uuids:
        raise InventoryError(f"{where}: device_uuid {entry['device_uuid']} names no device")
    try:
        pid = int(entry["pid"])
        used = int(entry.get("used_memory_mib", 0) or 0)
        uid = int(entry.get("uid", -1))
    except (TypeError, ValueError) as exc:
        raise InventoryError(f"{where}: {exc}") from exc
    if pid <= 0 or used < 0:
        raise InventoryError(f"{where}: pid must be positive and used_memory_mib not negative")
    return GpuProcess(pid=pid, device_uuid=str(entry["device_uuid"]), used_memory_mib=used,
                      uid=uid, user=str(entry.get("user", "")),
                      command=str(entry.get("command", "")))


# libyaml where PyYAML has it: the daemon reads the whole file at every refresh (every
# 10 s by default), and the pure-Python parser took ~50 ms of the interpreter for 64
# devices, twice (devices, then processes), in 5 ms slices that the event loop waited
# for, a grant among them; libyaml ~6 ms, once.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load(text: str, source: str) -> dict[str, Any]:
    try:
        doc = yaml.load(text, Loader=_Loader)  # a safe loader, C or Python
    except yaml.YAMLError as exc:
        raise InventoryError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list):
        raise InventoryError(f"{source}: expected a top-level 'devices:' list")
    _check_keys(doc, text, source)
    return doc


_TOP_KEYS = {"devices", "processes"}


def _check_keys(doc: dict[str, Any], text: str, source: str) -> None:
    """Refuse a misspelt key as the config does, with its line and a did-you-mean: one
    that is ignored (`usage_fil:`) simulates something else than the admin wrote."""
    levels: list[tuple[str, Any, set[str], tuple[Any, ...]]] = [("", doc, _TOP_KEYS, ())]
    for i, entry in enumerate(doc["devices"]):
        levels.append((f"devices[{i}]", entry, _KNOWN_KEYS, ("devices", i)))
        mig = entry.get("mig") if isinstance(entry, dict) else None
        for n, item in enumerate(mig if isinstance(mig, list) else []):
            levels.append((f"devices[{i}].mig[{n}]", item, _MIG_KEYS, ("devices", i, "mig", n)))
    listed = doc.get("processes")
    for i, entry in enumerate(listed if isinstance(listed, list) else []):
        levels.append((f"processes[{i}]", entry, _PROCESS_KEYS, ("processes", i)))
    for where, mapping, known, path in levels:
        unknown = sorted(str(k) for k in mapping if k not in known) if isinstance(mapping, dict) else []
        if unknown:
            key = unknown[0]
            line = _key_lines(text).get((*path, key))
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
            at = f"{source}:{line}" if line else source
            raise InventoryError(f"{at}: {where + ': ' if where else ''}unknown key {key!r}; {hint}")


def _key_lines(text: str) -> dict[tuple[Any, ...], int]:
    """Each mapping key's 1-based line, by its path (("devices", 0, "uuid")); only asked
    for when a key is wrong, so the second parse costs nothing otherwise."""
    lines: dict[tuple[Any, ...], int] = {}
    todo: list[tuple[yaml.Node, tuple[Any, ...]]] = [(yaml.compose(text, Loader=_Loader), ())]
    while todo:
        node, path = todo.pop()
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                lines[(*path, key.value)] = key.start_mark.line + 1
                todo.append((value, (*path, key.value)))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((item, (*path, i)) for i, item in enumerate(node.value))
    return lines


def _processes(doc: dict[str, Any], devices: tuple[Device, ...], source: str) -> tuple[GpuProcess, ...]:
    """The optional top-level `processes:` list: simulated GPU processes (no lease
    needed), each on a device of `devices`."""
    listed = doc.get("processes") or []
    if not isinstance(listed, list):
        raise InventoryError(f"{source}: 'processes:' must be a list")
    uuids = {d.uuid for d in devices}
    return tuple(_process(e, i, source, uuids) for i, e in enumerate(listed))


def _devices(doc: dict[str, Any], source: str) -> tuple[Device, ...]:
    devices = tuple(d for i, e in enumerate(doc["devices"]) for d in _device(e, i, source))
    uuids = [d.uuid for d in devices] + [d.parent_uuid for d in devices if d.mig_index == 0]
    dupes = sorted({u for u in uuids if uuids.count(u) > 1})
    if dupes:
        raise InventoryError(f"{source}: duplicate uuid(s) {', '.join(dupes)}")
    # One node opened for one device's holder must not open another device too (a MIG
    # instance's nodes begin with its GPU's, which every instance of it needs).
    nodes = [n for d in devices for n in d.device_nodes if not (d.mig_index > 0 and n in _gpu_nodes(d, devices))]
    shared = sorted({n for n in nodes if nodes.count(n) > 1})
    if shared:
        raise InventoryError(f"{source}: device node(s) {', '.join(shared)} listed for more than one device")
    return devices


def _gpu_nodes(instance: Device, devices: tuple[Device, ...]) -> tuple[str, ...]:
    first = next(d for d in devices if d.parent_uuid == instance.parent_uuid and d.mig_index == 0)
    return first.device_nodes


def _usage(doc: dict[str, Any], devices: tuple[Device, ...], source: str) -> tuple[GpuProcess, ...]:
    """The processes each device's (or instance's) usage_file names, with the memory each uses."""
    found: list[GpuProcess] = []
    entries = doc["devices"]
    for index, entry in enumerate(entries):
        where = f"{source}: devices[{index}]"
        listed = entry.get("mig") or [entry]
        for n, item in enumerate(listed):
            uuid = str(item["uuid"])
            at = f"{where}.mig[{n}]" if "mig" in entry else where
            found += [GpuProcess(pid=pid, device_uuid=uuid, used_memory_mib=mib)
                      for pid, mib in read_usage(item, at).items()]
    return tuple(found)


def parse_inventory(text: str, source: str = "<inventory>") -> tuple[Device, ...]:
    """The devices of an inventory file's text."""
    return _devices(_load(text, source), source)


class SimulatedProbe:
    """Reads the inventory file on every probe, so editing it simulates hot-plug and faults."""

    vendor = "simulated"

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def probe(self) -> ProbeResult:
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise InventoryError(f"{self.path}: cannot read: {exc.strerror}") from exc
        source = str(self.path)
        doc = _load(text, source)  # once: devices and processes come from one parse
        devices = _devices(doc, source)
        processes = _processes(doc, devices, source) + _usage(doc, devices, source)
        verdict = ProbeVerdict(
            "simulated", True, f"{len(devices)} simulated device(s) from {self.path}"
        )
        return ProbeResult(verdict=verdict, devices=devices, processes=processes)
