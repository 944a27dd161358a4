"""AMD GPUs through amdsmi (ROCm's management library and its Python package).

Like NVML, amdsmi reads the kernel driver (amdgpu/KFD) without starting the HIP runtime.
Calls go through one wrapper: NOT_SUPPORTED and other library errors degrade one field
to `Unavailable`; a processor that disappears mid-probe is reported unhealthy. Status
codes are amdsmi.h's (stable across ROCm 6 and 7), kept here as numbers because older
amdsmi packages lack some names (AMDSMI_STATUS_DRIVER_NOT_LOADED).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

from brokerd.devices.model import Device, GpuProcess, ProbeResult, ProbeVerdict
from brokerd.devices.probes.base import FieldLog, FieldReader, Unavailable, library_loads, unavailable
from brokerd.devices.probes.drm import render_nodes

MIB = 1024 * 1024

_NOT_SUPPORTED = 2
_NOT_YET_IMPLEMENTED = 3
_FAIL_LOAD_MODULE = 4
_NO_PERM = 10
_INIT_ERROR = 18
_NOT_FOUND = 31
_NOT_INIT = 32
_DRIVER_NOT_LOADED = 34

AMD_SMI_LIBRARY = "libamd_smi.so"  # ROCm's (amd-smi-lib), what the amdsmi binding loads
_NO_LIBRARY = (f"{AMD_SMI_LIBRARY} not found: ROCm's amd-smi library is not installed "
               "(amd-smi-lib from ROCm's repository, into /opt/rocm/lib)")
_INIT_REASONS = {
    _DRIVER_NOT_LOADED: "amdgpu driver not loaded (try `modprobe amdgpu`; see `dmesg`)",
    _FAIL_LOAD_MODULE: "amdgpu driver not loaded: amdsmi could not open the kernel module",
    _NO_PERM: "permission denied opening /dev/kfd and /dev/dri: run the daemon as root or "
    "as a user in the render and video groups",
    _INIT_ERROR: "amdsmi could not start: is the amdgpu driver loaded and /dev/kfd present?",
}

# Used when amdsmi's ASIC info carries no target_graphics_version (amdsmi before 6.2).
# PCI device id -> gfx target, from AMD's Instinct spec sheets and the LLVM AMDGPU docs.
_GFX_BY_DEVICE_ID = {
    0x738C: "gfx908",  # Instinct MI100
    0x740C: "gfx90a",  # Instinct MI250X / MI250 (one GCD)
    0x740F: "gfx90a",  # Instinct MI210
    0x74A1: "gfx942",  # Instinct MI300X
}


def _error_code(exc: BaseException) -> int | None:
    code = getattr(exc, "err_code", None)
    if code is None and callable(getattr(exc, "get_error_code", None)):
        code = exc.get_error_code()
    return int(code) if isinstance(code, int) else None


class _Reader(FieldReader):
    """amdsmi calls for one processor."""

    package = "amdsmi"

    def __init__(self, amdsmi: Any, log: FieldLog) -> None:
        super().__init__(amdsmi, amdsmi.AmdSmiException, log)

    def classify(self, exc: BaseException) -> Unavailable:
        code = _error_code(exc)
        if code == _NOT_FOUND:
            self.log.lost = f"amdsmi: {exc}"
        elif code in (_NOT_SUPPORTED, _NOT_YET_IMPLEMENTED):
            return Unavailable("not supported on this device")
        return Unavailable(f"amdsmi: {exc}")


def _number(value: Any) -> int | float | None:
    """amdsmi writes "N/A" (or a max-int sentinel turned into "N/A") for unknown values."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def _driver_version(driver: Any) -> str:
    version = driver.get("driver_version") if not isinstance(driver, Unavailable) else None
    return version if isinstance(version, str) and version != "N/A" else ""


def _gfx(asic: Any) -> str:
    if isinstance(asic, Unavailable):
        return ""
    target = asic.get("target_graphics_version")
    if isinstance(target, str) and target.startswith("gfx") and target != "gfx":
        return target.lower()
    device_id = asic.get("device_id")
    try:
        number = int(str(device_id), 16) if isinstance(device_id, str) else int(device_id)
    except (TypeError, ValueError):
        return ""
    return _GFX_BY_DEVICE_ID.get(number, "")


class AmdSmiProbe:
    """Finds AMD GPUs (each GCD of an MI250X is one device) and their processes."""

    vendor = "amd"

    def __init__(self, rocm_root: Path = Path("/opt/rocm"), sysfs_root: Path = Path("/sys")) -> None:
        # The ROCm release is not in amdsmi; /opt/rocm/.info/version holds it.
        self.rocm_root = Path(rocm_root)
        # The render node of each GPU (brokerd/devices/probes/drm.py) is found from its bus id.
        self.sysfs_root = Path(sysfs_root)

    def probe(self) -> ProbeResult:
        try:
            # amdsmi's wrapper loads libamd_smi.so at import and prints to stdout when it cannot
            # (which would land in `--probe --json`), then fails with OSError or KeyError.
            with contextlib.redirect_stdout(io.StringIO()):
                import amdsmi
        except ImportError:
            if not library_loads(AMD_SMI_LIBRARY) and not (self.rocm_root / "lib" / AMD_SMI_LIBRARY).exists():
                return unavailable(self.vendor, _NO_LIBRARY)
            return unavailable(
                self.vendor,
                f"{AMD_SMI_LIBRARY} is present but amdsmi, its Python binding, is not installed beside the "
                "broker (the vaccel package ships it; pip: vaccel[amd], or pip install /opt/rocm/share/amd_smi)",
            )
        except (OSError, KeyError) as exc:
            return unavailable(self.vendor, f"{_NO_LIBRARY} ({type(exc).__name__}: {exc})")
        try:
            amdsmi.amdsmi_init()
        except amdsmi.AmdSmiException as exc:
            reason = _INIT_REASONS.get(_error_code(exc), f"amdsmi failed to start: {exc}")
            return unavailable(self.vendor, reason)
        try:
            return self._probe(amdsmi)
        except Exception as exc:  # a binding bug must not take the daemon down
            return unavailable(self.vendor, f"amdsmi probe failed: {type(exc).__name__}: {exc}")
        finally:
            # Shutdown only releases amdsmi's handles; nothing to recover on failure.
            with contextlib.suppress(amdsmi.AmdSmiException):
                amdsmi.amdsmi_shut_down()

    def _rocm_version(self) -> str:
        try:
            return (self.rocm_root / ".info" / "version").read_text().strip()
        except OSError:
            return ""

    def _probe(self, amdsmi: Any) -> ProbeResult:
        handles = _Reader(amdsmi, FieldLog()).call("amdsmi_get_processor_handles")
        if isinstance(handles, Unavailable):
            return unavailable(self.vendor, f"amdsmi cannot list GPUs: {handles.reason}")
        if not handles:
            return unavailable(self.vendor, "amdsmi works but reports no AMD GPU")
        rocm = self._rocm_version()
        devices: list[Device] = []
        processes: list[GpuProcess] = []
        notes: list[str] = []
        for position, handle in enumerate(handles):
            found = self._device(amdsmi, position, handle, rocm)
            if isinstance(found, str):
                notes.append(found)
                continue
            devices.append(found[0])
            processes.extend(found[1])
        if not devices:
            return unavailable(self.vendor, "; ".join(notes))
        driver = devices[0].driver_version or "?"
        summary = f"{len(devices)} AMD GPU(s), amdgpu {driver}" + (f", ROCm {rocm}" if rocm else "")
        return ProbeResult(ProbeVerdict(self.vendor, True, "; ".join([summary, *notes])),
                           tuple(devices), tuple(processes))

    def _device(
        self, amdsmi: Any, position: int, handle: Any, rocm: str
    ) -> tuple[Device, list[GpuProcess]] | str:
        log = FieldLog()
        r = _Reader(amdsmi, log)
        uuid = r.get("uuid", "amdsmi_get_gpu_device_uuid", handle)
        if isinstance(uuid, Unavailable) or not uuid:
            return f"AMD GPU {position} has no readable UUID ({getattr(uuid, 'reason', 'empty')})"
        asic = r.get("asic", "amdsmi_get_gpu_asic_info", handle)
        bdf = r.get("pci_bus_id", "amdsmi_get_gpu_device_bdf", handle)
        usage = r.get("memory", "amdsmi_get_gpu_vram_usage", handle)
        vram = r.get("vram_info", "amdsmi_get_gpu_vram_info", handle)
        driver = r.get("driver_version", "amdsmi_get_gpu_driver_info", handle)
        numa = r.get("numa_node", "amdsmi_topo_get_numa_node_number", handle)
        enum = r.call("amdsmi_get_gpu_enumeration_info", handle)
        extra: dict[str, object] = {"amdsmi_index": position}
        total, used = self._memory(usage, vram)
        bandwidth = self._bandwidth(r, handle, vram, extra)
        # HIP and ROCR number devices by their own enumeration, which amdsmi >= 6.4
        # reports; older ones list processors in the same KFD order.
        hip_id = _number(enum.get("hip_id")) if not isinstance(enum, Unavailable) else None
        if not isinstance(enum, Unavailable) and enum.get("hip_uuid"):
            extra["hip_uuid"] = enum["hip_uuid"]
        problems = self._health(amdsmi, r, handle, extra)
        procs = self._processes(r, handle, str(uuid))
        if log.lost:
            problems.insert(0, f"GPU stopped answering ({log.lost}); it needs a reset")
        if log.missing:
            extra["unavailable"] = dict(log.missing)
        gfx = _gfx(asic)
        name = asic.get("market_name") if not isinstance(asic, Unavailable) else None
        bus_id = str(bdf).lower() if not isinstance(bdf, Unavailable) else ""
        device = Device(
            index=position,
            uuid=str(uuid),
            vendor="amd",
            name=name if isinstance(name, str) and name != "N/A" else f"AMD GPU {position}",
            memory_mib=total,
            backend="rocm",
            arch=gfx,
            compute_capability=gfx,
            pci_bus_id=bus_id,
            driver_version=_driver_version(driver),
            runtime_version=rocm,
            memory_bandwidth_gbps=bandwidth,
            memory_used_mib=used,
            numa_node=numa if isinstance(numa, int) else -1,
            healthy=not problems,
            health_reason="; ".join(problems),
            visible_id=str(int(hip_id)) if hip_id is not None else str(position),
            device_nodes=render_nodes(self.sysfs_root / "bus/pci/devices" / bus_id) if bus_id else (),
            extra=extra,
        )
        return device, procs

    @staticmethod
    def _memory(usage: Any, vram: Any) -> tuple[int, int]:
        """(total, used) in MiB; amdsmi reports VRAM in MB meaning MiB."""
        total = used = 0
        if not isinstance(usage, Unavailable):
            total = int(_number(usage.get("vram_total")) or 0)
            used = int(_number(usage.get("vram_used")) or 0)
        if not total and not isinstance(vram, Unavailable):
            total = int(_number(vram.get("vram_size")) or 0)
        return total, used

    @staticmethod
    def _bandwidth(r: _Reader, handle: Any, vram: Any, extra: dict[str, object]) -> float:
        """amdsmi >= 6.3 reports the peak (GB/s); otherwise bus width x max memory clock
        x 2 (HBM is double data rate)."""
        if isinstance(vram, Unavailable):
            return 0.0
        peak = _number(vram.get("vram_max_bandwidth"))
        if peak:
            return float(peak)
        width = _number(vram.get("vram_bit_width"))
        clk_type = getattr(getattr(r.library, "AmdSmiClkType", None), "MEM", None)
        if not width or clk_type is None:
            return 0.0
        clock = r.get("max_memory_clock", "amdsmi_get_clock_info", handle, clk_type)
        max_clk = _number(clock.get("max_clk")) if not isinstance(clock, Unavailable) else None
        if not max_clk:
            return 0.0
        extra["memory_bus_width_bits"] = width
        extra["max_memory_clock_mhz"] = max_clk
        return round(width / 8 * max_clk * 2 / 1000, 1)

    @staticmethod
    def _health(amdsmi: Any, r: _Reader, handle: Any, extra: dict[str, object]) -> list[str]:
        problems: list[str] = []
        activity = r.get("utilization", "amdsmi_get_gpu_activity", handle)
        if not isinstance(activity, Unavailable):
            gfx, umc = _number(activity.get("gfx_activity")), _number(activity.get("umc_activity"))
            if gfx is not None:
                extra["utilization_gpu_pct"] = gfx
            if umc is not None:
                extra["utilization_memory_pct"] = umc
        sensor = getattr(getattr(amdsmi, "AmdSmiTemperatureType", None), "HOTSPOT", None)
        metric = getattr(getattr(amdsmi, "AmdSmiTemperatureMetric", None), "CURRENT", None)
        if sensor is not None and metric is not None:
            temp = r.get("temperature_c", "amdsmi_get_temp_metric", handle, sensor, metric)
            if _number(temp) is not None:
                extra["temperature_c"] = temp
        ecc = r.get("ecc", "amdsmi_get_gpu_total_ecc_count", handle)
        if not isinstance(ecc, Unavailable):
            uncorrectable = _number(ecc.get("uncorrectable_count")) or 0
            extra["ecc_uncorrectable"] = uncorrectable
            extra["ecc_correctable"] = _number(ecc.get("correctable_count")) or 0
            if uncorrectable:
                problems.append(f"{uncorrectable} uncorrectable ECC error(s): "
                                "check `amd-smi metric --ecc` and reset the GPU")
        return problems

    @staticmethod
    def _processes(r: _Reader, handle: Any, uuid: str) -> list[GpuProcess]:
        listed = r.get("processes", "amdsmi_get_gpu_process_list", handle)
        if isinstance(listed, Unavailable):
            return []
        found: list[GpuProcess] = []
        for item in listed:
            # amdsmi >= 6.1 returns dicts; older versions return handles to look up.
            info = item if isinstance(item, dict) else r.get(
                "processes", "amdsmi_get_gpu_process_info", handle, item)
            if isinstance(info, Unavailable) or not isinstance(info.get("pid"), int):
                continue
            usage = info.get("memory_usage")
            vram = _number(usage.get("vram_mem")) if isinstance(usage, dict) else None
            if vram is None:
                vram = _number(info.get("mem")) or 0
            name = info.get("name")
            found.append(GpuProcess(
                pid=info["pid"], device_uuid=uuid, used_memory_mib=int(vram) // MIB,
                command=name if isinstance(name, str) and name != "N/A" else "",
            ))
        return found
