"""NVIDIA GPUs through NVML (the nvidia-ml-py package, module `pynvml`).

NVML is the driver's management library: it reads device facts and running processes
without creating a CUDA context, so the daemon never pins a GPU by probing it.

Every NVML call goes through one wrapper (`_Reader.get`): a field the driver cannot
give (NotSupported on a consumer card, an old driver without the symbol, ...) becomes an
`Unavailable` value and is listed in `Device.extra["unavailable"]`; it never drops the
device. A GPU that falls off the bus between two calls (NVML_ERROR_GPU_IS_LOST) is
reported unhealthy with what was read before, so it is not granted and its holder can
be told. A GPU in MIG mode is offered as its MIG instances (brokerd/devices/probes/nvidia_mig.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from brokerd.devices.model import Device, GpuProcess, ProbeResult, ProbeVerdict
from brokerd.devices.probes import nvidia_mig as mig
from brokerd.devices.probes.base import FieldLog, FieldReader, Unavailable, library_loads, unavailable

MIB = 1024 * 1024

# pynvml error codes, as in nvml.h; kept here so the verdict logic does not depend on
# which nvidia-ml-py version defines which constant.
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_LIB_RM_VERSION_MISMATCH = 18

NVML_LIBRARY = "libnvidia-ml.so.1"  # the driver's, what NVML's binding loads
_INIT_REASONS = {
    _LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 not found: the NVIDIA driver is not installed "
    "(or its libraries are not on the loader path)",
    _DRIVER_NOT_LOADED: "NVIDIA driver not loaded: libnvidia-ml.so.1 is present but the "
    "kernel module is not (try `modprobe nvidia`; see `dmesg`)",
    _NO_PERMISSION: "permission denied opening the NVIDIA devices (/dev/nvidia*): run the "
    "daemon as root or as a user that may open them",
    _LIB_RM_VERSION_MISMATCH: "NVIDIA driver/library version mismatch: the loaded kernel "
    "module and libnvidia-ml.so differ (reboot or reload the module after a driver upgrade)",
}


class _Reader(FieldReader):
    """NVML calls for one device (or the system)."""

    package = "nvidia-ml-py"

    def __init__(self, nvml: Any, log: FieldLog) -> None:
        super().__init__(nvml, nvml.NVMLError, log)

    def classify(self, exc: BaseException) -> Unavailable:
        code = getattr(exc, "value", None)
        if code in (_GPU_IS_LOST, _RESET_REQUIRED):
            self.log.lost = f"NVML: {exc}"
        elif code == _NOT_SUPPORTED:
            return Unavailable("not supported on this device")
        elif code == _FUNCTION_NOT_FOUND:
            return Unavailable("the installed driver lacks this NVML function")
        return Unavailable(f"NVML: {exc}")


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def normalise_bus_id(raw: Any) -> str:
    """NVML writes "00000000:07:00.0"; sysfs and CUDA_DEVICE_ORDER users write
    "0000:07:00.0". Keep the 4-digit domain form, lower case."""
    text = _text(raw).strip().lower()
    domain, sep, rest = text.partition(":")
    if sep and len(domain) > 4 and domain.lstrip("0") == domain[-4:].lstrip("0"):
        return f"{domain[-4:]}:{rest}"
    return text


def cuda_version_text(raw: int) -> str:
    """NVML's CUDA driver version 12040 -> "12.4"."""
    return f"{raw // 1000}.{(raw % 1000) // 10}"


def bandwidth_gbps(bus_width_bits: int, max_memory_clock_mhz: int) -> float:
    """Theoretical peak: bus width x max memory clock x 2 (double data rate), in GB/s.
    NVML reports HBM and GDDR clocks so that this gives the datasheet figure
    (A100 80GB: 5120 bit x 1593 MHz x 2 = 2039 GB/s)."""
    return round(bus_width_bits / 8 * max_memory_clock_mhz * 2 / 1000, 1)


class NvmlProbe:
    """Finds NVIDIA GPUs and their compute processes through NVML."""

    vendor = "nvidia"

    def __init__(self, sysfs_root: Path = Path("/sys"), mig_minors: Path = mig.MIG_MINORS) -> None:
        # sysfs gives the NUMA node when the driver's NVML lacks nvmlDeviceGetNumaNodeId.
        self.sysfs_root = Path(sysfs_root)
        self.mig_minors = Path(mig_minors)  # the driver's MIG access nodes, where it uses them

    def probe(self) -> ProbeResult:
        try:
            import pynvml
        except ImportError:
            # What the host lacks first: without the driver's library the binding would not help.
            if not library_loads(NVML_LIBRARY):
                return unavailable(self.vendor, _INIT_REASONS[_LIBRARY_NOT_FOUND])
            return unavailable(self.vendor, f"{NVML_LIBRARY} is present but its Python binding nvidia-ml-py is not "
                               "installed beside the broker (the vaccel package ships it; pip: vaccel[nvidia])")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            return unavailable(self.vendor, _INIT_REASONS.get(code, f"NVML failed to start: {exc}"))
        try:
            return self._probe(pynvml)
        except Exception as exc:  # a binding bug must not take the daemon down
            return unavailable(self.vendor, f"NVML probe failed: {type(exc).__name__}: {exc}")
        finally:
            # Shutdown only drops NVML's reference count; a failure leaks nothing that
            # the next nvmlInit does not reuse.
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()

    def _probe(self, nvml: Any) -> ProbeResult:
        system = _Reader(nvml, FieldLog())
        driver = system.get("driver_version", "nvmlSystemGetDriverVersion")
        cuda = system.get("runtime_version", "nvmlSystemGetCudaDriverVersion")
        count = system.get("count", "nvmlDeviceGetCount")
        if isinstance(count, Unavailable):
            return unavailable(self.vendor, f"NVML cannot count GPUs: {count.reason}")
        if count == 0:
            return unavailable(self.vendor, "NVML works but reports no NVIDIA GPU")
        devices: list[Device] = []
        processes: list[GpuProcess] = []
        notes: list[str] = []
        for index in range(count):
            found = self._device(nvml, index, _text(driver or ""),
                                 cuda_version_text(cuda) if isinstance(cuda, int) else "")
            if isinstance(found, str):
                notes.append(found)
                continue
            device, procs = found
            if device.extra.get("mig_mode") == "enabled":  # its instances are the devices (nvidia_mig.py)
                reader = _Reader(nvml, FieldLog())
                minor = device.extra.get("device_minor")
                found_mig = mig.instances(reader, device, reader.call("nvmlDeviceGetHandleByIndex", index),
                                          minor if isinstance(minor, int) else None, mig.cap_minors(self.mig_minors))
                devices.extend(found_mig[0])
                processes.extend(found_mig[1])
                notes.extend([found_mig[2]] if found_mig[2] else [])
                continue
            devices.append(device)
            processes.extend(procs)
        if not devices:
            return unavailable(self.vendor, "; ".join(notes))
        summary = f"{len(devices)} NVIDIA GPU(s), driver {_text(driver or '?')}"
        if isinstance(cuda, int):
            summary += f", CUDA {cuda_version_text(cuda)}"
        verdict = ProbeVerdict(self.vendor, True, "; ".join([summary, *notes]))
        return ProbeResult(verdict, tuple(devices), tuple(processes))

    def _device(
        self, nvml: Any, index: int, driver: str, cuda: str
    ) -> tuple[Device, list[GpuProcess]] | str:
        """One GPU, or a note saying why it could not be identified."""
        log = FieldLog()
        r = _Reader(nvml, log)
        handle = r.get("handle", "nvmlDeviceGetHandleByIndex", index)
        if isinstance(handle, Unavailable):
            return f"GPU {index} cannot be opened ({handle.reason})"
        uuid = r.get("uuid", "nvmlDeviceGetUUID", handle)
        if isinstance(uuid, Unavailable):
            return f"GPU {index} has no readable UUID ({uuid.reason})"
        uuid = _text(uuid)
        name = r.get("name", "nvmlDeviceGetName", handle)
        pci = r.get("pci_bus_id", "nvmlDeviceGetPciInfo", handle)
        bus_id = normalise_bus_id(pci.busId) if not isinstance(pci, Unavailable) else ""
        memory, reserved = self._memory(r, handle)
        cc = r.get("compute_capability", "nvmlDeviceGetCudaComputeCapability", handle)
        width = r.get("memory_bus_width", "nvmlDeviceGetMemoryBusWidth", handle)
        clock = r.get("max_memory_clock", "nvmlDeviceGetMaxClockInfo", handle,
                      getattr(nvml, "NVML_CLOCK_MEM", 2))
        numa = r.get("numa_node", "nvmlDeviceGetNumaNodeId", handle)
        # The driver names each GPU's node by its minor number: /dev/nvidia<minor>.
        minor = r.get("device_node", "nvmlDeviceGetMinorNumber", handle)
        if isinstance(numa, Unavailable):
            numa = self._sysfs_numa(bus_id)
        extra: dict[str, object] = {"nvml_index": index}
        if isinstance(minor, int):
            extra["device_minor"] = minor
        if reserved is not None:
            extra["memory_reserved_mib"] = reserved
        if isinstance(width, int) and isinstance(clock, int):
            extra["memory_bus_width_bits"] = width
            extra["max_memory_clock_mhz"] = clock
        problems = self._health(nvml, r, handle, extra)
        procs = self._processes(r, handle, uuid)
        if log.lost:
            problems.insert(0, f"GPU stopped answering ({log.lost}); it needs a reset")
        if log.missing:
            extra["unavailable"] = dict(log.missing)
        total_mib = used_mib = 0
        if memory is not None:
            total_mib, used_mib = memory.total // MIB, memory.used // MIB
        device = Device(
            index=index,
            uuid=uuid,
            vendor="nvidia",
            name=_text(name) if not isinstance(name, Unavailable) else f"NVIDIA GPU {index}",
            memory_mib=total_mib,
            backend="cuda",
            arch=f"sm_{cc[0]}{cc[1]}" if not isinstance(cc, Unavailable) else "",
            compute_capability=f"{cc[0]}.{cc[1]}" if not isinstance(cc, Unavailable) else "",
            pci_bus_id=bus_id,
            driver_version=driver,
            runtime_version=cuda,
            memory_bandwidth_gbps=(
                bandwidth_gbps(width, clock)
                if isinstance(width, int) and isinstance(clock, int) else 0.0
            ),
            memory_used_mib=used_mib,
            numa_node=numa if isinstance(numa, int) else -1,
            healthy=not problems,
            health_reason="; ".join(problems),
            device_nodes=(f"/dev/nvidia{minor}",) if isinstance(minor, int) else (),
            extra=extra,
        )
        return device, procs

    def _memory(self, r: _Reader, handle: Any) -> tuple[Any, int | None]:
        """(memory info with .total/.used in bytes, reserved MiB or None). The v2 query
        keeps the driver's reservation out of `used`, which the zombie check needs."""
        v2 = getattr(r.library, "nvmlMemory_v2", None)
        if v2 is not None:
            # Drivers before r510 refuse the versioned struct; fall back to v1 quietly.
            info = r.call("nvmlDeviceGetMemoryInfo", handle, v2)
            if not isinstance(info, Unavailable):
                return info, getattr(info, "reserved", 0) // MIB
        info = r.get("memory", "nvmlDeviceGetMemoryInfo", handle)
        return (None, None) if isinstance(info, Unavailable) else (info, None)

    def _health(self, nvml: Any, r: _Reader, handle: Any, extra: dict[str, object]) -> list[str]:
        """Facts that make a device unfit to hand out, in words; also fills `extra`."""
        problems: list[str] = []
        mig = r.get("mig_mode", "nvmlDeviceGetMigMode", handle)
        if not isinstance(mig, Unavailable):
            current, pending = mig
            extra["mig_mode"] = "enabled" if current else "disabled"
            if pending != current:
                extra["mig_mode_pending"] = "enabled" if pending else "disabled"
        util = r.get("utilization", "nvmlDeviceGetUtilizationRates", handle)
        if not isinstance(util, Unavailable):
            extra["utilization_gpu_pct"] = util.gpu
            extra["utilization_memory_pct"] = util.memory
        temp = r.get("temperature_c", "nvmlDeviceGetTemperature", handle,
                     getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
        if not isinstance(temp, Unavailable):
            extra["temperature_c"] = temp
        ecc = r.get("ecc_uncorrected_volatile", "nvmlDeviceGetTotalEccErrors", handle,
                    getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                    getattr(nvml, "NVML_VOLATILE_ECC", 0))
        if not isinstance(ecc, Unavailable):
            extra["ecc_uncorrected_volatile"] = ecc
            if ecc > 0:
                problems.append(f"{ecc} uncorrectable ECC error(s) since the last driver "
                                "load: reset the GPU before reuse")
        pending = r.get("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if not isinstance(pending, Unavailable):
            is_pending = pending == getattr(nvml, "NVML_FEATURE_ENABLED", 1)
            extra["retired_pages_pending"] = is_pending
            if is_pending:
                problems.append("retired memory pages pending: reset the GPU to retire them")
        rows = r.get("remapped_rows", "nvmlDeviceGetRemappedRows", handle)
        if not isinstance(rows, Unavailable):
            corrected, uncorrected, is_pending, failed = rows
            extra["remapped_rows"] = {"correctable": corrected, "uncorrectable": uncorrected,
                                      "pending": bool(is_pending), "failure": bool(failed)}
            if failed:
                problems.append("row remapping failed: the GPU's memory needs service")
            elif is_pending:
                problems.append("row remapping pending: reset the GPU to apply it")
        return problems

    def _processes(self, r: _Reader, handle: Any, uuid: str) -> list[GpuProcess]:
        procs = r.get("processes", "nvmlDeviceGetComputeRunningProcesses", handle)
        if isinstance(procs, Unavailable):
            return []
        found: dict[int, GpuProcess] = {}
        for p in procs:
            # usedGpuMemory is None where the driver cannot attribute memory (no
            # permission, WDDM); the process still occupies the device.
            used = (p.usedGpuMemory or 0) // MIB
            prior = found.get(p.pid)
            total = used + (prior.used_memory_mib if prior else 0)
            found[p.pid] = GpuProcess(pid=p.pid, device_uuid=uuid, used_memory_mib=total)
        return list(found.values())

    def _sysfs_numa(self, bus_id: str) -> int:
        if not bus_id:
            return -1
        try:
            return int((self.sysfs_root / "bus/pci/devices" / bus_id / "numa_node").read_text())
        except (OSError, ValueError):
            return -1
