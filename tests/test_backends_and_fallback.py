"""The environment a lease applies per backend, and the CPU fallback failing closed."""

from __future__ import annotations

from pathlib import Path

import brokerd.devices.probes as probes
from brokerd.devices.model import ProbeVerdict, Snapshot
from brokerd.devices.watch import lost_probes
from vaccel_common.backends import lease_env


def test_cuda_lease_env_is_by_uuid_in_pci_order():
    env = lease_env(lease_id="l-1", backend_name="cuda", device_ids=["GPU-a", "GPU-b"],
                    allocator_config="expandable_segments:True")
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["VACCEL_LEASE_ID"] == "l-1"


def test_rocm_filters_with_rocr_and_renumbers_hip():
    env = lease_env(lease_id="l-1", backend_name="rocm", device_ids=["GPU-x", "GPU-y"],
                    allocator_config="expandable_segments:True")
    assert env["ROCR_VISIBLE_DEVICES"] == "GPU-x,GPU-y"
    assert env["HIP_VISIBLE_DEVICES"] == "0,1", "HIP numbers within what ROCR left"
    assert env["PYTORCH_HIP_ALLOC_CONF"] == "expandable_segments:True"


def test_xpu_uses_ordinals_in_pci_order():
    env = lease_env(lease_id="l-1", backend_name="xpu", device_ids=["1"])
    assert env["ZE_AFFINITY_MASK"] == "1"
    assert env["ZE_ENABLE_PCI_ID_DEVICE_ORDER"] == "1"


def test_cpu_lease_hides_every_gpu():
    env = lease_env(lease_id="l-1", backend_name="cpu", device_ids=["CPU-0"])
    assert env["CUDA_VISIBLE_DEVICES"] == "-1"
    assert env["HIP_VISIBLE_DEVICES"] == "-1"
    assert env["ROCR_VISIBLE_DEVICES"] == "-1"


def test_no_cpu_fallback_when_gpu_nodes_exist_but_probes_failed(tmp_path: Path, monkeypatch):
    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(probes, "GPU_DEVICE_NODES", (str(node),))
    snapshot = probes.run_probes([])
    assert snapshot.devices == ()
    assert snapshot.verdicts[-1].vendor == "cpu" and not snapshot.verdicts[-1].available
    assert str(node) in snapshot.verdicts[-1].reason
    monkeypatch.setattr(probes, "GPU_DEVICE_NODES", (str(tmp_path / "absent"),))
    assert [d.vendor for d in probes.run_probes([]).devices] == ["cpu"]


def test_a_probe_that_stops_finding_devices_is_noticed():
    ok = Snapshot((), verdicts=(ProbeVerdict("nvidia", True, "2 GPUs"),))
    gone = Snapshot((), verdicts=(ProbeVerdict("nvidia", False, "driver not loaded"),
                                  ProbeVerdict("cpu", True, "cpu")))
    assert lost_probes(ok, gone) == ["nvidia"]
    assert lost_probes(gone, ok) == []


def test_socket_mode_must_be_an_octal_string(tmp_path: Path):
    import pytest

    from brokerd.config.loader import ConfigError, load_config

    config = tmp_path / "brokerd.toml"
    config.write_text("[server]\nsocket_mode = 0o660\n")
    with pytest.raises(ConfigError, match='socket_mode = "0660"'):
        load_config(config)
    config.write_text('[server]\nsocket_mode = "0660"\n')
    assert load_config(config).socket_mode == 0o660
