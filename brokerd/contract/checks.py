"""The checks of a requirement against each device and against the client's environment.

Each check yields one `CheckLine` (OK, INFO, WARN or ERROR) with a message that names what was
required and what was found, so `vaccel check` can print it as it is. A device is
eligible when none of its lines is an ERROR; the requirement is satisfiable when no
host-wide check failed and enough eligible devices share one backend (one process
drives one backend). Health and current use are not looked at here: the lease manager
filters those, and a busy device still makes a contract "satisfiable later".
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from brokerd.contract.accel_config import AcceleratorConfig
from brokerd.contract.config_checks import amp_line, memory_section_lines
from brokerd.contract.model import CheckLine, ClientFacts, Evaluation, Requirement
from brokerd.contract.spec import TORCH_NAMES, Dependency, RuntimeSpec
from brokerd.contract.torch_build import wheel_line
from brokerd.contract.versions import (
    at_least,
    compare_driver_versions,
    describe_arch_list,
    examples_meeting,
    kernel_support,
    parse_driver_version,
    try_capability,
)
from brokerd.devices.model import Device
from brokerd.devices.vendors import NAME_PREFIX_WORDS, SERIES_WORDS
from vaccel_common.backends import BACKENDS
from vaccel_common.units import format_mib

# Names a check line carries; `vaccel check --json` users match on them.
BACKEND = "Backend"
MEMORY = "GPU memory"
CAPABILITY = "GPU compute capability"
BANDWIDTH = "Memory bandwidth"
DRIVER = "Driver version"
TORCH_BUILD = "PyTorch build"
KERNELS = "Kernel image"
RUNTIME = "Runtime version"
DISTRIBUTED = "torch.distributed"



def short_name(device: Device) -> str:
    """The model in a device's marketing name, for messages: the vendor table's prefix
    words dropped, a series word kept with the model it precedes ("Max 1550"), and a
    board suffix cut off ("A100-SXM4-80GB" -> "A100")."""
    words = [w for w in device.name.split() if w.lower() not in NAME_PREFIX_WORDS]
    if not words:
        return device.name or device.uuid
    if words[0].lower() in SERIES_WORDS and len(words) > 1:
        return f"{words[0]} {words[1]}"
    return re.split(r"-(?=[A-Z0-9]{3,})", words[0])[0]


def evaluate(requirement: Requirement, devices: Sequence[Device]) -> Evaluation:
    """Check `requirement` against every device in `devices` (healthy or not: health is
    the lease manager's business, so a sick device still counts as 'could satisfy later')
    and against the client's environment. The result is remembered on the requirement
    for the same set of devices (order aside: nothing reads the order of `eligible`)."""
    key = tuple(sorted(devices, key=lambda d: d.uuid))
    for seen, evaluation in requirement.memo:
        if seen == key:
            return evaluation
    evaluation = _evaluate(requirement, devices)
    requirement.memo[:] = [(key, evaluation)]
    return evaluation


def _evaluate(requirement: Requirement, devices: Sequence[Device]) -> Evaluation:
    spec = requirement.spec if requirement.spec is not None else RuntimeSpec()
    config = requirement.config if requirement.config is not None else AcceleratorConfig()
    min_memory = max(requirement.min_memory_mib, spec.min_memory_mib)
    host = tuple(host_checks(spec, config, requirement.facts))
    per_device = {
        d.uuid: tuple(device_checks(d, requirement, spec, config, min_memory)) for d in devices
    }
    eligible = tuple(d.uuid for d in devices
                     if not any(ln.level == "ERROR" for ln in per_device[d.uuid]))
    reason, suggestions = _verdict(requirement, devices, host, per_device, eligible, spec)
    return Evaluation(
        eligible=eligible,
        per_device=per_device,
        host_checks=host,
        suggestions=suggestions,
        satisfiable=not reason,
        reason=reason,
    )


# --- per device --------------------------------------------------------------------------


def device_checks(device: Device, requirement: Requirement, spec: RuntimeSpec,
                  config: AcceleratorConfig, min_memory_mib: int) -> list[CheckLine]:
    """The check lines of one device, in the order `vaccel check` prints them."""
    name = short_name(device)
    lines: list[CheckLine] = []

    def add(level: str, check: str, message: str, suggestion: str = "") -> None:
        lines.append(CheckLine(level, check, message, device.uuid, suggestion))

    if config.backend != "auto":
        if device.backend == config.backend:
            add("OK", BACKEND, f"{device.backend} ({name})")
        else:
            add("ERROR", BACKEND, f"required {config.backend_as_written}, found "
                f"{device.backend} ({name})",
                f"set backend: auto in {config.name}, or run on a host with "
                f"{config.backend_as_written} devices")
    have = format_mib(device.memory_mib)
    if min_memory_mib and device.memory_mib < min_memory_mib:
        add("ERROR", MEMORY, f"required {format_mib(min_memory_mib)}, found {have} ({name})",
            "lower min_memory (smaller batch, gradient checkpointing) or run on a device "
            "with more memory")
    else:
        add("OK", MEMORY, f"{have} ({name})")
    if spec.compute_capabilities:
        lines.extend(_capability_line(device, name, spec))
    if spec.memory_bandwidth_gbps:
        need = spec.memory_bandwidth_gbps
        if not device.memory_bandwidth_gbps:
            add("WARN", BANDWIDTH, f"unknown for {name}; required {need:g} GB/s")
        elif device.memory_bandwidth_gbps < need:
            add("ERROR", BANDWIDTH, f"required {need:g} GB/s, found "
                f"{device.memory_bandwidth_gbps:g} GB/s ({name})",
                "relax memory_bandwidth_gbps or run on a device with faster memory")
        else:
            add("OK", BANDWIDTH, f"{device.memory_bandwidth_gbps:g} GB/s ({name})")
    minimum = spec.driver_minimum(device.vendor)
    if minimum and device.vendor != "cpu":
        lines.extend(_driver_line(device, name, minimum))
    facts = requirement.facts
    needs_distributed = spec.distributed or spec.full_distribution
    if facts.torch_version and device.simulated and not facts.torch_backend:
        # A simulated device computes on the CPU (see vaccel.accelerator): a CPU-only torch
        # is exactly what runs there, so there is nothing to refuse or warn about.
        add("OK", TORCH_BUILD, f"torch {facts.torch_version} (CPU build); {name} is simulated and "
            "computes on the CPU")
        if spec.vendor_agnostic_wheel:
            lines.append(wheel_line(device, name, facts))
        if needs_distributed:
            lines.extend(_distributed_line(device, facts, required=True, backend="cpu"))
    elif facts.torch_version and device.vendor != "cpu":
        torch_lines = _torch_lines(device, name, facts)
        if spec.vendor_agnostic_wheel:
            torch_lines.append(wheel_line(device, name, facts))
        if requirement.spec is None and requirement.config is None:
            torch_lines = [_advisory(ln) for ln in torch_lines]
        lines.extend(torch_lines)
        if requirement.gpus > 1 or needs_distributed:
            lines.extend(_distributed_line(device, facts, required=needs_distributed))
    lines.extend(memory_section_lines(device, name, config))
    return lines


def _advisory(line: CheckLine) -> CheckLine:
    """Without a contract the broker cannot know the job runs this torch (the process
    may drive the device another way), so a torch mismatch warns instead of refusing."""
    if line.level != "ERROR":
        return line
    return replace(line, level="WARN", message=f"{line.message} (not enforced: no runtime "
                   "contract given)")


def _capability_line(device: Device, name: str, spec: RuntimeSpec) -> list[CheckLine]:
    required = " or ".join(c.canonical for c in spec.compute_capabilities)
    cap = try_capability(device.arch)
    minimum = spec.capability_for(cap.vendor) if cap else None
    found = f"{device.arch or device.vendor} ({name})"
    if cap and minimum and at_least(cap, minimum):
        return [CheckLine("OK", CAPABILITY, found, device.uuid)]
    examples = list(dict.fromkeys(e for c in spec.compute_capabilities
                                  for e in examples_meeting(c)))
    hint = f"run on a host with {'/'.join(examples)}, or " if examples else ""
    return [CheckLine("ERROR", CAPABILITY, f"required {required}, found {found}", device.uuid,
                      f"{hint}relax gpu_compute_capability")]


def _driver_line(device: Device, name: str, minimum: str) -> list[CheckLine]:
    try:
        parse_driver_version(device.driver_version)
    except ValueError:
        return [CheckLine("WARN", DRIVER, f"unknown for {name}; required >= {minimum}",
                          device.uuid)]
    if compare_driver_versions(device.driver_version, minimum) < 0:
        return [CheckLine("ERROR", DRIVER, f"required >= {minimum}, found "
                          f"{device.driver_version} ({name})", device.uuid,
                          "ask the host's admin to update the driver, or relax "
                          "driver_version_min")]
    return [CheckLine("OK", DRIVER, f"{device.driver_version} ({name})", device.uuid)]


def _torch_lines(device: Device, name: str, facts: ClientFacts) -> list[CheckLine]:
    torch = f"torch {facts.torch_version}"
    if not facts.torch_backend:
        return [CheckLine(
            "ERROR", TORCH_BUILD,
            f"{torch} is a CPU-only build; it cannot use {name} ({device.backend})",
            device.uuid,
            f"install a torch build for {device.backend} in this environment, or ask for "
            "no GPU")]
    if facts.torch_backend != device.backend:
        return [CheckLine(
            "ERROR", TORCH_BUILD,
            f"{torch} is built for {facts.torch_backend}; {name} needs a build for "
            f"{device.backend}",
            device.uuid, f"install a torch build for {device.backend}, or set backend: "
            f"{facts.torch_backend} in the accelerator config")]
    return [_kernel_line(device, name, facts), *_runtime_line(device, name, facts)]


def _kernel_line(device: Device, name: str, facts: ClientFacts) -> CheckLine:
    torch = f"torch {facts.torch_version}"
    arch = device.arch or device.compute_capability
    if not facts.kernel_archs:
        return CheckLine("WARN", KERNELS, f"{torch} reported no architecture list; cannot "
                         f"confirm kernels for {arch} ({name})", device.uuid)
    carries = describe_arch_list(facts.kernel_archs, facts.ptx_archs)
    support = kernel_support(arch, facts.kernel_archs, facts.ptx_archs)
    if support.status == "exact":
        return CheckLine("OK", KERNELS, f"{torch} carries {arch} ({name})", device.uuid)
    if support.status == "compatible":
        return CheckLine("OK", KERNELS, f"{torch} runs its {support.via} kernels on {arch} "
                         f"({name})", device.uuid)
    if support.status == "ptx":
        return CheckLine("WARN", KERNELS, f"{torch} carries {carries}; {name} is {arch}: "
                         f"kernels would JIT from PTX {support.via} (slow first run)",
                         device.uuid, f"install a torch build compiled for {arch}")
    if support.status == "unknown":
        return CheckLine("WARN", KERNELS, f"{torch} carries {carries}; cannot tell whether "
                         f"that covers {arch} ({name})", device.uuid)
    return CheckLine("ERROR", KERNELS, f"no kernels for {arch} ({name}): {torch} carries "
                     f"{carries}", device.uuid,
                     f"install a torch build compiled for {arch}, or run on a device this "
                     "build supports")


def _runtime_line(device: Device, name: str, facts: ClientFacts) -> list[CheckLine]:
    built, supported = facts.torch_runtime_version, device.runtime_version
    try:
        major_built = parse_driver_version(built)[0]
        major_supported = parse_driver_version(supported)[0]
    except ValueError:
        return []
    if major_built > major_supported:
        return [CheckLine("ERROR", RUNTIME, f"torch was built for runtime {built}; the driver "
                          f"of {name} supports up to {supported}", device.uuid,
                          f"install a torch build for runtime {supported} or older, or ask "
                          "the admin to update the driver")]
    if compare_driver_versions(built, supported) > 0:
        return [CheckLine("WARN", RUNTIME, f"torch was built for runtime {built}; the driver "
                          f"of {name} supports up to {supported} (minor-version "
                          "compatibility; JIT-compiled code may fail)", device.uuid)]
    return [CheckLine("OK", RUNTIME, f"torch runtime {built}, driver supports {supported} "
                      f"({name})", device.uuid)]


def _distributed_line(device: Device, facts: ClientFacts, *, required: bool,
                      backend: str = "") -> list[CheckLine]:
    """torch.distributed with the collective of `backend` (the device's when not given)."""
    backend = backend or device.backend
    wanted = BACKENDS[backend].dist_backend if backend in BACKENDS else ""
    level = "ERROR" if required else "WARN"
    if not facts.distributed_available:
        return [CheckLine(level, DISTRIBUTED, f"not available in torch {facts.torch_version}",
                          device.uuid, "install a torch build with distributed support")]
    if wanted and wanted not in facts.distributed_backends:
        have = ", ".join(facts.distributed_backends) or "none"
        return [CheckLine(level, DISTRIBUTED, f"backend {wanted} missing (has {have})",
                          device.uuid, f"install a torch build with {wanted}")]
    return [CheckLine("OK", DISTRIBUTED, f"backend {wanted or 'available'}", device.uuid)]


# --- host-wide ---------------------------------------------------------------------------


def host_checks(spec: RuntimeSpec, config: AcceleratorConfig,
                facts: ClientFacts) -> list[CheckLine]:
    """Checks of the client's environment that hold for every device: dependencies."""
    lines: list[CheckLine] = []
    if not facts.python_version:
        if spec.dependencies:
            lines.append(CheckLine("WARN", "Client environment", "the client sent no facts "
                                   "about its environment; dependency checks skipped"))
    else:
        where = f" ({facts.python_executable})" if facts.python_executable else ""
        lines.append(CheckLine("OK", "Python", facts.python_version + where))
        # One index for all dependencies: matching each against every installed package
        # was quadratic, seconds of CPU for a legal spec a client can send.
        installed: dict[str, str] = {}
        for package, version in facts.packages.items():
            installed.setdefault(_normalise(package), version)
        lines.extend(_dependency_line(dep, facts, installed) for dep in spec.dependencies)
    if config.grad_scaler and config.amp_dtype in ("bfloat16", "none"):
        lines.append(CheckLine("WARN", "AMP", f"grad_scaler has no effect with dtype "
                               f"{config.amp_dtype} ({config.name})"))
    elif config.amp_dtype:
        lines.append(amp_line(config))
    return lines


def _normalise(package: str) -> str:
    return re.sub(r"[-_.]+", "-", package).lower()


def _dependency_line(dep: Dependency, facts: ClientFacts, packages: dict[str, str]) -> CheckLine:
    is_torch = dep.name.lower() in TORCH_NAMES
    label = "PyTorch version" if is_torch else f"{dep.name} version"
    installed = facts.torch_version if is_torch else packages.get(_normalise(dep.name), "")
    pip_name = "torch" if is_torch else dep.name
    pin = f"'{pip_name}{dep.version_range.specifier}'" if dep.version_range else pip_name
    pip = f"{facts.python_executable} -m pip" if facts.python_executable else "pip"
    if not installed:
        # Which Python was looked at: the job's (vaccel run asks it), which a student can
        # install into, not the lab's vaccel install, which they cannot.
        if facts.python_executable:
            return CheckLine("ERROR", label, f"not installed in {facts.python_executable}",
                             suggestion=f"{pip} install {pin}, or run the job with a Python that has it")
        return CheckLine("ERROR", label, "not installed in the client's environment",
                         suggestion=f"pip install {pin}")
    if dep.version_range is None:
        return CheckLine("OK", label, installed)
    if dep.version_range.contains(installed):
        return CheckLine("OK", label, f"{installed} (matches {dep.version_range})")
    return CheckLine("ERROR", label, f"{installed} does not match {dep.version_range} "
                     "(lower bound inclusive, upper exclusive)",
                     suggestion=f"{pip} install {pin}, or widen version_range")


# --- verdict -----------------------------------------------------------------------------


def _inventory(devices: Sequence[Device]) -> str:
    counts = Counter(f"{short_name(d)} ({d.arch or d.vendor})" for d in devices)
    return ", ".join(f"{n}x {what}" if n > 1 else what for what, n in counts.items())


def _verdict(requirement: Requirement, devices: Sequence[Device], host: tuple[CheckLine, ...],
             per_device: dict[str, tuple[CheckLine, ...]], eligible: tuple[str, ...],
             spec: RuntimeSpec) -> tuple[str, tuple[str, ...]]:
    """("", ()) when satisfiable, else one sentence why and what to do."""
    host_errors = [ln for ln in host if ln.level == "ERROR"]
    if host_errors:
        first = host_errors[0]
        return (f"{first.name}: {first.message}",
                tuple(dict.fromkeys(ln.suggestion for ln in host_errors if ln.suggestion)))
    need = requirement.gpus
    if need <= 0:
        return "", ()
    by_uuid = {d.uuid: d for d in devices}
    groups = Counter(by_uuid[u].backend for u in eligible)
    if groups and max(groups.values()) >= need:
        return "", ()
    if not devices:
        return f"asks for {need} device(s); this host has none", ()
    # Say "contract" only when the user gave one; a plain `--gpus 8` is just a request.
    what = "the contract" if requirement.spec is not None or requirement.config is not None else "the request"
    if not eligible:
        return _nothing_fits(devices, per_device, spec, what)
    good = [by_uuid[u] for u in eligible]
    if len(eligible) >= need:
        spread = ", ".join(f"{n} {b}" for b, n in groups.items())
        return (f"asks for {need} devices meeting {what} on one backend; the eligible "
                f"ones are split across backends ({spread})",
                ("ask for fewer devices, or set backend in the accelerator config",))
    return (f"asks for {need} devices meeting {what}; this host has only "
            f"{len(eligible)} ({_inventory(good)})",
            (f"ask for at most {len(eligible)} device(s), or run on a larger host",))


def _nothing_fits(devices: Sequence[Device], per_device: dict[str, tuple[CheckLine, ...]],
                  spec: RuntimeSpec, what: str) -> tuple[str, tuple[str, ...]]:
    failing = Counter(ln.name for lines in per_device.values() for ln in lines
                      if ln.level == "ERROR")
    inventory = _inventory(devices)
    suggestions: list[str] = []
    for check, _ in failing.most_common():
        lines = [ln for lines in per_device.values() for ln in lines
                 if ln.name == check and ln.level == "ERROR"]
        if check == CAPABILITY:
            required = " or ".join(c.canonical for c in spec.compute_capabilities)
            examples = list(dict.fromkeys(e for c in spec.compute_capabilities
                                          for e in examples_meeting(c)))
            where = f"Run on a host with {'/'.join(examples)}, or relax" if examples else "Relax"
            suggestions.append(f"needs {required}; this host has {inventory}. "
                               f"{where} gpu_compute_capability")
        elif lines[0].suggestion:
            suggestions.append(f"{check}: {lines[0].suggestion}")
    top = failing.most_common(1)[0][0]
    sample = next(ln for lines in per_device.values() for ln in lines
                  if ln.name == top and ln.level == "ERROR")
    reason = f"no device on this host meets {what}; {top}: {sample.message}"
    return reason, tuple(dict.fromkeys(suggestions))
