"""NvmlProbe against a fake `pynvml` at the binding boundary.

The fake module reuses nvidia-ml-py's real NVMLError classes and NVML_* constants, so
error codes and exception types behave as they do against libnvidia-ml.so; only the
functions are served from tests/fixtures/probes/nvml_h100.yaml.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from brokerd.devices.probes.nvidia import (
    NvmlProbe,
    bandwidth_gbps,
    cuda_version_text,
    normalise_bus_id,
)

real = pytest.importorskip("pynvml")

FIXTURE = Path(__file__).parent / "fixtures" / "probes" / "nvml_h100.yaml"
MIB = 1024 * 1024


def load_fixture() -> dict[str, Any]:
    return yaml.safe_load(FIXTURE.read_text())


class FakeNvml:
    """Builds a module object that looks like pynvml to the probe."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.init_error: int | None = None
        self.fail: dict[tuple[int, str], int] = {}  # (device index, function) -> code
        self.lose_after: dict[int, str] = {}  # device index -> function after which lost
        self.lost: set[int] = set()
        self.shutdowns = 0
        self.inits = 0

    def error(self, code: int) -> Exception:
        return real.NVMLError(code)

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("pynvml")
        for name in dir(real):
            if name.startswith(("NVML_", "NVMLError")):
                setattr(mod, name, getattr(real, name))
        mod.nvmlMemory_v2 = real.nvmlMemory_v2
        devs = self.data["devices"]

        def init() -> None:
            self.inits += 1
            if self.init_error is not None:
                raise self.error(self.init_error)

        def shutdown() -> None:
            self.shutdowns += 1

        def device_call(function: str):
            def wrap(impl):
                def call(handle: int, *args: Any) -> Any:
                    if handle in self.lost:
                        raise self.error(real.NVML_ERROR_GPU_IS_LOST)
                    code = self.fail.get((handle, function))
                    if code is not None:
                        raise self.error(code)
                    value = impl(devs[handle], *args)
                    if self.lose_after.get(handle) == function:
                        self.lost.add(handle)
                    if value == "NotSupported":
                        raise self.error(real.NVML_ERROR_NOT_SUPPORTED)
                    return value
                setattr(mod, function, call)
                return call
            return wrap

        mod.nvmlInit = init
        mod.nvmlShutdown = shutdown
        mod.nvmlSystemGetDriverVersion = lambda: self.data["system"]["driver_version"]
        mod.nvmlSystemGetCudaDriverVersion = lambda: self.data["system"]["cuda_driver_version"]
        mod.nvmlDeviceGetCount = lambda: len(devs)

        def handle_by_index(index: int) -> int:
            code = self.fail.get((index, "nvmlDeviceGetHandleByIndex"))
            if code is not None:
                raise self.error(code)
            return index

        mod.nvmlDeviceGetHandleByIndex = handle_by_index

        @device_call("nvmlDeviceGetUUID")
        def _uuid(d):
            return d["uuid"]

        @device_call("nvmlDeviceGetName")
        def _name(d):
            return d["name"]

        @device_call("nvmlDeviceGetPciInfo")
        def _pci(d):
            return SimpleNamespace(busId=d["pci_bus_id"].encode())

        @device_call("nvmlDeviceGetMemoryInfo")
        def _memory(d, version=None):
            total, used = d["memory_total_mib"] * MIB, d["memory_used_mib"] * MIB
            if version is None:
                reserved = d["memory_reserved_mib"] * MIB
                return SimpleNamespace(total=total, used=used + reserved,
                                       free=total - used - reserved)
            return SimpleNamespace(total=total, used=used, reserved=d["memory_reserved_mib"] * MIB,
                                   free=total - used)

        @device_call("nvmlDeviceGetCudaComputeCapability")
        def _cc(d):
            return tuple(d["compute_capability"])

        @device_call("nvmlDeviceGetMemoryBusWidth")
        def _width(d):
            return d["memory_bus_width"]

        @device_call("nvmlDeviceGetMaxClockInfo")
        def _clock(d, clock_type):
            assert clock_type == real.NVML_CLOCK_MEM
            return d["max_memory_clock_mhz"]

        @device_call("nvmlDeviceGetNumaNodeId")
        def _numa(d):
            return d["numa_node"]

        @device_call("nvmlDeviceGetMinorNumber")
        def _minor(d):
            return d["minor_number"]

        @device_call("nvmlDeviceGetMigMode")
        def _mig(d):
            return list(d["mig_mode"])

        @device_call("nvmlDeviceGetUtilizationRates")
        def _util(d):
            return SimpleNamespace(**d["utilization"])

        @device_call("nvmlDeviceGetTemperature")
        def _temp(d, sensor):
            assert sensor == real.NVML_TEMPERATURE_GPU
            return d["temperature_c"]

        @device_call("nvmlDeviceGetTotalEccErrors")
        def _ecc(d, error_type, counter):
            assert (error_type, counter) == (real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                             real.NVML_VOLATILE_ECC)
            return d["ecc_uncorrected_volatile"]

        @device_call("nvmlDeviceGetRetiredPagesPendingStatus")
        def _retired(d):
            return d["retired_pages_pending"]

        @device_call("nvmlDeviceGetRemappedRows")
        def _rows(d):
            return tuple(d["remapped_rows"])

        @device_call("nvmlDeviceGetComputeRunningProcesses")
        def _procs(d):
            return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used_mib"] * MIB
                                    if p["used_mib"] is not None else None)
                    for p in d["processes"]]

        return mod


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nvml = FakeNvml(load_fixture())
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    return nvml


def reinstall(monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())


def test_h100_devices_read_in_full(fake: FakeNvml) -> None:
    result = NvmlProbe().probe()
    assert result.verdict.available
    assert "2 NVIDIA GPU(s), driver 535.129.03, CUDA 12.2" in result.verdict.reason
    first, second = result.devices
    assert first.uuid == "GPU-5a10e6e5-95f7-2785-ed63-6f6147f304f7"
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert (first.vendor, first.backend) == ("nvidia", "cuda")
    assert first.memory_mib == 81559
    assert first.memory_used_mib == 0  # v2 keeps the driver's reservation out of "used"
    assert first.extra["memory_reserved_mib"] == 329
    assert (first.arch, first.compute_capability) == ("sm_90", "9.0")
    assert first.pci_bus_id == "0000:18:00.0"
    assert second.pci_bus_id == "0000:2a:00.0"
    assert (first.driver_version, first.runtime_version) == ("535.129.03", "12.2")
    assert first.memory_bandwidth_gbps == pytest.approx(3352.3)
    assert first.numa_node == 0
    assert first.healthy and first.health_reason == ""
    assert first.extra["mig_mode"] == "disabled"
    assert second.extra["utilization_gpu_pct"] == 97
    assert second.extra["temperature_c"] == 58
    assert first.visible == first.uuid  # CUDA takes UUIDs: no ordinal needed
    assert fake.shutdowns == 1


def test_not_supported_degrades_one_field_only(fake: FakeNvml) -> None:
    result = NvmlProbe().probe()
    device = result.devices[0]
    # Hopper answers NotSupported for retired pages: recorded, device kept and healthy.
    assert device.extra["unavailable"] == {"retired_pages_pending": "not supported on this device"}
    assert "retired_pages_pending" not in device.extra
    assert device.healthy


def test_many_fields_not_supported_still_keeps_the_device(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    for function in ("nvmlDeviceGetMemoryBusWidth", "nvmlDeviceGetTemperature",
                     "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMigMode",
                     "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows",
                     "nvmlDeviceGetNumaNodeId"):
        fake.fail[(0, function)] = real.NVML_ERROR_NOT_SUPPORTED
    reinstall(monkeypatch, fake)
    device = NvmlProbe(sysfs_root=Path("/nonexistent")).probe().devices[0]
    assert device.memory_bandwidth_gbps == 0.0
    assert device.numa_node == -1
    assert device.memory_mib == 81559
    assert {"memory_bus_width", "temperature_c", "utilization", "mig_mode",
            "ecc_uncorrected_volatile", "remapped_rows", "numa_node"} <= set(
        device.extra["unavailable"])
    assert device.healthy


def test_numa_falls_back_to_sysfs(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake.fail[(0, "nvmlDeviceGetNumaNodeId")] = real.NVML_ERROR_FUNCTION_NOT_FOUND
    reinstall(monkeypatch, fake)
    node = tmp_path / "bus/pci/devices/0000:18:00.0"
    node.mkdir(parents=True)
    (node / "numa_node").write_text("1\n")
    device = NvmlProbe(sysfs_root=tmp_path).probe().devices[0]
    assert device.numa_node == 1
    assert "driver lacks" in device.extra["unavailable"]["numa_node"]


def test_old_driver_without_memory_v2_falls_back_to_v1(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = fake.module()
    v1 = mod.nvmlDeviceGetMemoryInfo

    def only_v1(handle: int, version: Any = None) -> Any:
        if version is not None:
            raise real.NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        return v1(handle)

    mod.nvmlDeviceGetMemoryInfo = only_v1
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    device = NvmlProbe().probe().devices[1]
    assert device.memory_used_mib == 1030 + 329
    assert "memory_reserved_mib" not in device.extra
    assert "memory" not in device.extra.get("unavailable", {})


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (real.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1 not found"),
        (real.NVML_ERROR_DRIVER_NOT_LOADED, "driver not loaded"),
        (real.NVML_ERROR_NO_PERMISSION, "permission denied"),
        (real.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "version mismatch"),
        (real.NVML_ERROR_UNKNOWN, "NVML failed to start: Unknown Error"),
    ],
)
def test_init_failures_become_plain_word_verdicts(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch, code: int, words: str
) -> None:
    fake.init_error = code
    reinstall(monkeypatch, fake)
    result = NvmlProbe().probe()
    assert not result.verdict.available
    assert words in result.verdict.reason
    assert result.devices == ()
    assert fake.shutdowns == 0  # nothing to shut down when init failed


def test_missing_python_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    monkeypatch.setattr("brokerd.devices.probes.nvidia.library_loads", lambda name: name == "libnvidia-ml.so.1")
    result = NvmlProbe().probe()
    assert not result.verdict.available
    assert "libnvidia-ml.so.1 is present but its Python binding nvidia-ml-py is not installed" in result.verdict.reason


def test_without_binding_nor_driver_the_driver_library_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the host lacks is the driver (issue 41): its library, not the Python package."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr("brokerd.devices.probes.nvidia.library_loads", lambda name: False)
    result = NvmlProbe().probe()
    assert result.verdict.reason.startswith("libnvidia-ml.so.1 not found: the NVIDIA driver is not installed")
    assert "nvidia-ml-py" not in result.verdict.reason


def test_real_binding_without_a_driver_says_library_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real nvidia-ml-py on a machine without libnvidia-ml.so.1 (this CI host)."""
    import ctypes.util

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("an NVIDIA driver is installed here")
    monkeypatch.setitem(sys.modules, "pynvml", real)
    result = NvmlProbe().probe()
    assert not result.verdict.available
    assert result.verdict.reason.startswith("libnvidia-ml.so.1 not found")


def test_no_gpu(fake: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.data["devices"] = []
    reinstall(monkeypatch, fake)
    result = NvmlProbe().probe()
    assert not result.verdict.available
    assert result.verdict.reason == "NVML works but reports no NVIDIA GPU"


def test_gpu_lost_between_calls_is_reported_unhealthy(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.lose_after[1] = "nvmlDeviceGetName"
    reinstall(monkeypatch, fake)
    result = NvmlProbe().probe()
    assert result.verdict.available
    healthy, lost = result.devices
    assert healthy.healthy
    assert lost.uuid == "GPU-0f6a2a4c-3f8e-2c55-1b0e-9d7c1e4b2a11"
    assert lost.name == "NVIDIA H100 80GB HBM3"  # read before it fell off the bus
    assert not lost.healthy
    assert "GPU stopped answering (NVML: GPU is lost)" in lost.health_reason
    assert lost.memory_mib == 0  # nothing after the loss is made up
    assert [p for p in result.processes if p.device_uuid == lost.uuid] == []
    assert fake.shutdowns == 1


def test_gpu_that_cannot_be_opened_is_a_note_not_a_crash(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.fail[(0, "nvmlDeviceGetHandleByIndex")] = real.NVML_ERROR_NO_PERMISSION
    reinstall(monkeypatch, fake)
    result = NvmlProbe().probe()
    assert [d.index for d in result.devices] == [1]
    assert "GPU 0 cannot be opened (NVML: Insufficient Permissions)" in result.verdict.reason


def test_every_gpu_unreadable_gives_an_unavailable_verdict(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.lost = {0, 1}
    reinstall(monkeypatch, fake)
    result = NvmlProbe().probe()
    assert not result.verdict.available
    assert "GPU 0 has no readable UUID (NVML: GPU is lost)" in result.verdict.reason


def test_foreign_process_is_reported(fake: FakeNvml) -> None:
    result = NvmlProbe().probe()
    (proc,) = result.processes
    assert proc.pid == 12345
    assert proc.device_uuid == "GPU-0f6a2a4c-3f8e-2c55-1b0e-9d7c1e4b2a11"
    assert proc.used_memory_mib == 1024


def test_process_memory_unknown_still_counts_the_process(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.data["devices"][0]["processes"] = [{"pid": 7, "used_mib": None}]
    reinstall(monkeypatch, fake)
    procs = NvmlProbe().probe().processes
    assert (procs[0].pid, procs[0].used_memory_mib) == (7, 0)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("ecc_uncorrected_volatile", 2, "2 uncorrectable ECC error(s)"),
        ("retired_pages_pending", 1, "retired memory pages pending"),
        ("remapped_rows", [0, 1, 1, 0], "row remapping pending"),
        ("remapped_rows", [0, 3, 0, 1], "row remapping failed"),
    ],
)
def test_health_problems_make_the_device_unhealthy(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch, field: str, value: Any, words: str
) -> None:
    fake.data["devices"][0][field] = value
    reinstall(monkeypatch, fake)
    device = NvmlProbe().probe().devices[0]
    assert not device.healthy
    assert words in device.health_reason


def test_unexpected_binding_error_becomes_a_verdict(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod = fake.module()

    def broken() -> int:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    mod.nvmlDeviceGetCount = broken
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    result = NvmlProbe().probe()
    assert not result.verdict.available
    assert result.verdict.reason.startswith("NVML probe failed: UnicodeDecodeError")
    assert fake.shutdowns == 1


def test_helpers() -> None:
    assert normalise_bus_id(b"00000000:07:00.0") == "0000:07:00.0"
    assert normalise_bus_id("0000:C1:00.0") == "0000:c1:00.0"
    assert normalise_bus_id("00010000:07:00.0") == "00010000:07:00.0"
    assert cuda_version_text(12040) == "12.4"
    assert cuda_version_text(11080) == "11.8"
    assert bandwidth_gbps(5120, 1593) == pytest.approx(2039.0)  # A100 80GB datasheet


def test_device_node_comes_from_the_minor_number(fake: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node enforcement gates is /dev/nvidia<minor>, which need not follow NVML's index."""
    fake.data["devices"][1]["minor_number"] = 5
    reinstall(monkeypatch, fake)
    first, second = NvmlProbe().probe().devices
    assert (first.device_nodes, second.device_nodes) == (("/dev/nvidia0",), ("/dev/nvidia5",))


def test_unreadable_minor_number_leaves_the_device_without_a_node(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake.fail[(0, "nvmlDeviceGetMinorNumber")] = real.NVML_ERROR_NOT_SUPPORTED
    reinstall(monkeypatch, fake)
    device = NvmlProbe().probe().devices[0]
    assert device.device_nodes == ()  # enforcement then holds it back (fails closed)
    assert device.extra["unavailable"]["device_node"] == "not supported on this device"
    assert device.healthy
