"""AmdSmiProbe against a fake `amdsmi` module (the real wheel needs ROCm to import).

The fake mirrors amdsmi's Python API as documented in ROCm's py-interface
(amdsmi_interface.py / amdsmi_exception.py): AmdSmiException as the base class,
AmdSmiLibraryException(err_code) carrying amdsmi.h status codes, dict-shaped answers,
AmdSmiClkType / AmdSmiTemperatureType / AmdSmiTemperatureMetric enums.
"""

from __future__ import annotations

import sys
import types
from enum import IntEnum
from pathlib import Path
from typing import Any

import pytest
import yaml

from brokerd.devices.probes.amd import AmdSmiProbe

FIXTURE = Path(__file__).parent / "fixtures" / "probes" / "amdsmi_mi250x.yaml"

# amdsmi.h status codes
NOT_SUPPORTED, FAIL_LOAD_MODULE, NO_PERM, NOT_FOUND, DRIVER_NOT_LOADED = 2, 4, 10, 31, 34


class AmdSmiException(Exception):
    pass


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        super().__init__(err_code)
        self.err_code = abs(err_code)

    def get_error_code(self) -> int:
        return self.err_code

    def __str__(self) -> str:
        return f"An error occured with code: {self.err_code}"


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    MEM = 4


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0


class Handle:
    """amdsmi hands out opaque processor handles."""

    def __init__(self, index: int) -> None:
        self.index = index


class FakeAmdSmi:
    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.init_error: int | None = None
        self.fail: dict[tuple[int, str], int] = {}
        self.legacy_process_handles = False
        self.shutdowns = 0

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("amdsmi")
        mod.AmdSmiException = AmdSmiException
        mod.AmdSmiLibraryException = AmdSmiLibraryException
        mod.AmdSmiClkType = AmdSmiClkType
        mod.AmdSmiTemperatureType = AmdSmiTemperatureType
        mod.AmdSmiTemperatureMetric = AmdSmiTemperatureMetric
        devs = self.data["devices"]

        def init(flag: Any = None) -> None:
            if self.init_error is not None:
                raise AmdSmiLibraryException(self.init_error)

        def shut_down() -> None:
            self.shutdowns += 1

        def on_device(function: str, impl):
            def call(handle: Handle, *args: Any) -> Any:
                code = self.fail.get((handle.index, function))
                if code is not None:
                    raise AmdSmiLibraryException(code)
                return impl(devs[handle.index], *args)
            setattr(mod, function, call)

        mod.amdsmi_init = init
        mod.amdsmi_shut_down = shut_down
        mod.amdsmi_get_processor_handles = lambda: [Handle(i) for i in range(len(devs))]
        on_device("amdsmi_get_gpu_device_uuid", lambda d: d["uuid"])
        on_device("amdsmi_get_gpu_device_bdf", lambda d: d["bdf"])
        on_device("amdsmi_get_gpu_asic_info", lambda d: dict(d["asic"]))
        on_device("amdsmi_get_gpu_vram_usage", lambda d: dict(d["vram_usage"]))
        on_device("amdsmi_get_gpu_vram_info", lambda d: dict(d["vram_info"]))
        on_device("amdsmi_get_gpu_driver_info", lambda d: dict(d["driver"]))
        on_device("amdsmi_get_gpu_activity", lambda d: dict(d["activity"]))
        on_device("amdsmi_get_gpu_total_ecc_count", lambda d: dict(d["ecc"]))
        on_device("amdsmi_topo_get_numa_node_number", lambda d: d["numa_node"])
        on_device("amdsmi_get_gpu_enumeration_info", lambda d: dict(d["enumeration"]))

        def clock(d: dict[str, Any], clk_type: AmdSmiClkType) -> dict[str, Any]:
            assert clk_type is AmdSmiClkType.MEM
            return {"clk": 900, "min_clk": 500, "max_clk": d["max_memory_clock_mhz"],
                    "clk_locked": False, "clk_deep_sleep": "N/A"}

        def temp(d: dict[str, Any], sensor: Any, metric: Any) -> int:
            assert (sensor, metric) == (AmdSmiTemperatureType.HOTSPOT,
                                        AmdSmiTemperatureMetric.CURRENT)
            return d["hotspot_c"]

        def processes(d: dict[str, Any]) -> list[Any]:
            if self.legacy_process_handles:
                return [("proc", i) for i in range(len(d["processes"]))]
            return [dict(p) for p in d["processes"]]

        def process_info(d: dict[str, Any], ref: tuple[str, int]) -> dict[str, Any]:
            return dict(d["processes"][ref[1]])

        on_device("amdsmi_get_clock_info", clock)
        on_device("amdsmi_get_temp_metric", temp)
        on_device("amdsmi_get_gpu_process_list", processes)
        on_device("amdsmi_get_gpu_process_info", process_info)
        return mod


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAmdSmi:
    smi = FakeAmdSmi(yaml.safe_load(FIXTURE.read_text()))
    monkeypatch.setitem(sys.modules, "amdsmi", smi.module())
    return smi


@pytest.fixture
def rocm(tmp_path: Path) -> Path:
    (tmp_path / ".info").mkdir()
    (tmp_path / ".info" / "version").write_text("6.2.0-66\n")
    return tmp_path


def reinstall(monkeypatch: pytest.MonkeyPatch, smi: FakeAmdSmi) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", smi.module())


def test_mi250x_gcds_read_in_full(fake: FakeAmdSmi, rocm: Path) -> None:
    result = AmdSmiProbe(rocm_root=rocm).probe()
    assert result.verdict.available
    assert result.verdict.reason == "2 AMD GPU(s), amdgpu 6.8.5, ROCm 6.2.0-66"
    first, second = result.devices
    assert first.name == "AMD Instinct MI250X"
    assert (first.vendor, first.backend) == ("amd", "rocm")
    assert first.uuid == "5aff740c-0000-1000-80c1-a1b2c3d4e5f6"
    assert (first.arch, first.compute_capability) == ("gfx90a", "gfx90a")
    assert first.memory_mib == 65520
    assert second.memory_used_mib == 2058
    assert first.pci_bus_id == "0000:c1:00.0"
    assert first.driver_version == "6.8.5"
    assert first.runtime_version == "6.2.0-66"
    # vram_max_bandwidth is N/A here: 4096 bit x 1600 MHz x 2 = half the MI250X's 3.2768 TB/s
    assert first.memory_bandwidth_gbps == pytest.approx(1638.4)
    assert first.numa_node == 3
    assert (first.visible_id, second.visible_id) == ("0", "1")
    assert first.extra["hip_uuid"] == "GPU-8a1b2c3d4e5f6071"
    assert second.extra["utilization_gpu_pct"] == 100
    assert second.extra["temperature_c"] == 61
    assert first.healthy
    assert fake.shutdowns == 1


def test_processes_on_a_gcd(fake: FakeAmdSmi) -> None:
    (proc,) = AmdSmiProbe().probe().processes
    assert (proc.pid, proc.used_memory_mib, proc.command) == (4242, 2048, "python3")
    assert proc.device_uuid == "21ff740c-0000-1000-80c6-a1b2c3d4e5f7"


def test_older_amdsmi_process_handles(fake: FakeAmdSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.legacy_process_handles = True
    reinstall(monkeypatch, fake)
    (proc,) = AmdSmiProbe().probe().processes
    assert proc.pid == 4242


def test_reported_peak_bandwidth_wins(fake: FakeAmdSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.data["devices"][0]["vram_info"]["vram_max_bandwidth"] = 1638
    reinstall(monkeypatch, fake)
    assert AmdSmiProbe().probe().devices[0].memory_bandwidth_gbps == 1638.0


def test_gfx_from_device_id_when_amdsmi_is_old(
    fake: FakeAmdSmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    del fake.data["devices"][0]["asic"]["target_graphics_version"]
    reinstall(monkeypatch, fake)
    assert AmdSmiProbe().probe().devices[0].arch == "gfx90a"


def test_not_supported_degrades_one_field(
    fake: FakeAmdSmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    for function in ("amdsmi_get_gpu_activity", "amdsmi_get_temp_metric",
                     "amdsmi_get_gpu_total_ecc_count", "amdsmi_topo_get_numa_node_number",
                     "amdsmi_get_clock_info"):
        fake.fail[(0, function)] = NOT_SUPPORTED
    reinstall(monkeypatch, fake)
    device = AmdSmiProbe().probe().devices[0]
    assert device.healthy
    assert device.memory_mib == 65520
    assert device.numa_node == -1
    assert device.memory_bandwidth_gbps == 0.0
    assert set(device.extra["unavailable"]) == {
        "utilization", "temperature_c", "ecc", "numa_node", "max_memory_clock"}
    assert device.extra["unavailable"]["ecc"] == "not supported on this device"


def test_gcd_lost_between_calls(fake: FakeAmdSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.fail[(1, "amdsmi_get_gpu_vram_usage")] = NOT_FOUND
    reinstall(monkeypatch, fake)
    result = AmdSmiProbe().probe()
    lost = result.devices[1]
    assert not lost.healthy
    assert lost.health_reason.startswith("GPU stopped answering")
    assert lost.name == "AMD Instinct MI250X"
    assert result.processes == ()  # nothing read from a GPU that is gone
    assert result.devices[0].healthy


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (DRIVER_NOT_LOADED, "amdgpu driver not loaded"),
        (FAIL_LOAD_MODULE, "amdgpu driver not loaded"),
        (NO_PERM, "permission denied"),
        (99, "amdsmi failed to start"),
    ],
)
def test_init_failures(
    fake: FakeAmdSmi, monkeypatch: pytest.MonkeyPatch, code: int, words: str
) -> None:
    fake.init_error = code
    reinstall(monkeypatch, fake)
    result = AmdSmiProbe().probe()
    assert not result.verdict.available
    assert words in result.verdict.reason


def test_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monkeypatch.setattr("brokerd.devices.probes.amd.library_loads", lambda name: name == "libamd_smi.so")
    result = AmdSmiProbe().probe()
    assert not result.verdict.available
    assert result.verdict.reason.startswith("libamd_smi.so is present but amdsmi, its Python binding, is not installed")


def test_without_binding_nor_rocm_the_library_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monkeypatch.setattr("brokerd.devices.probes.amd.library_loads", lambda name: False)
    result = AmdSmiProbe(rocm_root=tmp_path).probe()
    assert result.verdict.reason.startswith("libamd_smi.so not found: ROCm's amd-smi library is not installed")


def _amdsmi_whose_import_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str) -> None:
    """An `amdsmi` package first on the path whose import runs `source` (the real wrapper's
    behaviour without ROCm's library)."""
    package = tmp_path / "amdsmi"
    package.mkdir()
    (package / "__init__.py").write_text(source)
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_the_real_binding_without_rocm_names_the_library_and_prints_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """amdsmi 7's wrapper prints a line and fails with KeyError at import without libamd_smi.so."""
    _amdsmi_whose_import_runs(monkeypatch, tmp_path, "print('Unable to find libamd_smi.so library')\n"
                                                     "_libraries = {}\n_libraries['libamd_smi.so']\n")
    result = AmdSmiProbe().probe()
    assert result.verdict.reason.startswith("libamd_smi.so not found")
    assert capsys.readouterr().out == ""


def test_missing_shared_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """amdsmi's wrapper loads libamd_smi.so at import time; without ROCm that fails."""
    _amdsmi_whose_import_runs(monkeypatch, tmp_path, "raise OSError('libamd_smi.so: cannot open shared object file')\n")
    result = AmdSmiProbe().probe()
    assert not result.verdict.available
    assert result.verdict.reason.startswith("libamd_smi.so not found")


def test_no_gpu(fake: FakeAmdSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.data["devices"] = []
    reinstall(monkeypatch, fake)
    result = AmdSmiProbe().probe()
    assert result.verdict.reason == "amdsmi works but reports no AMD GPU"
    assert fake.shutdowns == 1


def test_uncorrectable_ecc_is_unhealthy(fake: FakeAmdSmi, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.data["devices"][0]["ecc"]["uncorrectable_count"] = 4
    reinstall(monkeypatch, fake)
    device = AmdSmiProbe().probe().devices[0]
    assert not device.healthy
    assert "4 uncorrectable ECC error(s)" in device.health_reason


def test_render_node_is_found_through_the_bus_id(fake: FakeAmdSmi, rocm: Path, tmp_path: Path) -> None:
    """Each GCD is its own PCI function with its own render node; one that sysfs does not
    show has none (enforcement then holds it back)."""
    sysfs = tmp_path / "sys"
    drm = sysfs / "bus/pci/devices/0000:c1:00.0/drm"
    for name in ("card1", "renderD129"):
        (drm / name).mkdir(parents=True)
    first, second = AmdSmiProbe(rocm_root=rocm, sysfs_root=sysfs).probe().devices
    assert first.device_nodes == ("/dev/dri/renderD129",)
    assert second.device_nodes == ()
