"""probe_report / render_probe_text: what `vaccel-brokerd --probe [--json]` prints."""

from __future__ import annotations

import json
from pathlib import Path

from brokerd.devices.model import Device, GpuProcess, ProbeVerdict, Snapshot
from brokerd.devices.probe_report import probe_report, render_probe_text
from brokerd.devices.probes.simulated import SimulatedProbe


def snapshot() -> Snapshot:
    h100 = Device(index=0, uuid="GPU-5a10e6e5-95f7-2785-ed63-6f6147f304f7", vendor="nvidia",
                  name="NVIDIA H100 80GB HBM3", memory_mib=81559, backend="cuda", arch="sm_90",
                  compute_capability="9.0", driver_version="535.129.03",
                  memory_bandwidth_gbps=3352.3, memory_used_mib=1030,
                  extra={"remapped_rows": {"pending": False}, "odd": object(),
                         "unavailable": {"retired_pages_pending": "not supported"}})
    sick = Device(index=1, uuid="GPU-2", vendor="nvidia", name="NVIDIA H100 80GB HBM3",
                  memory_mib=0, backend="cuda", healthy=False,
                  health_reason="GPU stopped answering (NVML: GPU is lost)")
    verdicts = (ProbeVerdict("nvidia", True, "2 NVIDIA GPU(s), driver 535.129.03, CUDA 12.2"),
                ProbeVerdict("amd", False, "amdsmi is not installed"),
                ProbeVerdict("intel", False, "no Intel GPU in /sys/class/drm"))
    procs = (GpuProcess(12345, h100.uuid, 1024, uid=1002, user="bob", command="python3 x.py"),)
    return Snapshot((h100, sick), procs, verdicts)


def test_json_shape() -> None:
    report = probe_report(snapshot())
    text = json.dumps(report)  # everything JSON-safe, including odd extra values
    assert json.loads(text) == report
    first = report["devices"][0]
    for key in ("index", "uuid", "vendor", "name", "memory_mib", "backend", "healthy",
                "pci_bus_id", "arch", "driver_version", "memory_bandwidth_gbps"):
        assert key in first
    assert first["visible_id"] == first["uuid"]
    assert first["extra"]["remapped_rows"] == {"pending": False}
    assert isinstance(first["extra"]["odd"], str)
    assert report["probes"][1] == {"vendor": "amd", "available": False,
                                   "reason": "amdsmi is not installed"}
    assert report["processes"][0]["pid"] == 12345
    assert report["simulated"] is False


def test_text_table_and_verdicts() -> None:
    text = render_probe_text(snapshot())
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["IDX", "VENDOR", "NAME"]
    assert "1030/81559 MiB" in lines[1] and "sm_90" in lines[1] and "3352.3 GB/s" in lines[1]
    assert "UNHEALTHY: GPU stopped answering (NVML: GPU is lost)" in lines[2]
    assert "  amd       none   amdsmi is not installed" in lines
    assert "  nvidia    found  2 NVIDIA GPU(s), driver 535.129.03, CUDA 12.2" in lines
    assert any("12345" in ln and "bob" in ln and "python3 x.py" in ln for ln in lines)


def test_no_devices() -> None:
    empty = Snapshot((), (), (ProbeVerdict("nvidia", False, "libnvidia-ml.so.1 not found"),))
    text = render_probe_text(empty)
    assert text.startswith("No devices found.\n")
    assert probe_report(empty)["devices"] == []


def test_simulated_processes_reach_the_report(tmp_path: Path) -> None:
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(
        "devices:\n"
        "  - {vendor: nvidia, name: A100, uuid: GPU-a, memory_mib: 81920, memory_used_mib: 3000}\n"
        "  - {vendor: nvidia, name: A100, uuid: GPU-b, memory_mib: 81920}\n"
        "processes:\n"
        "  - {device_uuid: GPU-b, pid: 4321, used_memory_mib: 1024, user: bob,\n"
        "     command: python3 train.py}\n"
    )
    result = SimulatedProbe(inventory).probe()
    (proc,) = result.processes
    assert (proc.pid, proc.device_uuid, proc.used_memory_mib, proc.user) == (
        4321, "GPU-b", 1024, "bob")
    snap = Snapshot(result.devices, result.processes, (result.verdict,), simulated=True)
    assert "simulated inventory" in render_probe_text(snap)
    assert probe_report(snap)["processes"][0]["command"] == "python3 train.py"


def test_a_simulated_refresh_parses_its_file_once_with_libyaml_where_pyyaml_has_it(tmp_path: Path, monkeypatch):
    # The daemon re-reads the inventory at every refresh; a 64-device file took ~50 ms of
    # the interpreter per pure-Python parse, and each refresh parsed it twice.
    import yaml

    inventory = tmp_path / "inv.yaml"
    inventory.write_text("devices:\n  - {vendor: nvidia, name: A100, uuid: GPU-a, memory_mib: 81920}\n"
                         "processes:\n  - {device_uuid: GPU-a, pid: 4321}\n")
    loaders = []
    real_load = yaml.load

    def load(stream, Loader):  # PyYAML's own keyword
        loaders.append(Loader)
        return real_load(stream, Loader=Loader)

    monkeypatch.setattr(yaml, "load", load)
    monkeypatch.setattr(yaml, "safe_load", lambda stream: load(stream, yaml.SafeLoader))
    result = SimulatedProbe(inventory).probe()
    assert [d.uuid for d in result.devices] == ["GPU-a"] and [p.pid for p in result.processes] == [4321]
    assert loaders == [yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader]
