"""A simulated mixed host for the contract and policy tests: Device objects built
directly, as the probes would build them."""

from __future__ import annotations

from dataclasses import replace

from brokerd.contract import ClientFacts, Requirement
from brokerd.contract.accel_config import parse_accelerator_config
from brokerd.contract.spec import parse_runtime_spec
from brokerd.devices.model import Device

A100 = Device(
    index=0, uuid="GPU-a100-0", vendor="nvidia", name="NVIDIA A100-SXM4-80GB",
    memory_mib=81920, backend="cuda", arch="sm_80", compute_capability="8.0",
    driver_version="535.104.05", runtime_version="12.2", memory_bandwidth_gbps=2039,
    numa_node=0, interconnect_group="nvlink0",
)
T4 = Device(
    index=1, uuid="GPU-t4-1", vendor="nvidia", name="Tesla T4", memory_mib=15360,
    backend="cuda", arch="sm_75", compute_capability="7.5", driver_version="525.60.13",
    runtime_version="12.0", memory_bandwidth_gbps=320, numa_node=1,
)
MI250X = Device(
    index=2, uuid="GPU-mi250x-2", vendor="amd", name="AMD Instinct MI250X",
    memory_mib=65536, backend="rocm", arch="gfx90a", compute_capability="gfx90a",
    driver_version="6.7.0", memory_bandwidth_gbps=1638, numa_node=0,
)
MAX1550 = Device(
    index=3, uuid="GPU-max-3", vendor="intel", name="Intel(R) Data Center GPU Max 1550",
    memory_mib=131072, backend="xpu", arch="Xe_HPC", compute_capability="Xe_HPC",
    driver_version="1.3.29735", memory_bandwidth_gbps=3276, numa_node=1,
)
MIXED = (A100, T4, MI250X, MAX1550)

CUDA_FACTS = ClientFacts(
    python_version="3.11.9", torch_version="2.1.0+cu121", torch_backend="cuda",
    torch_runtime_version="12.1",
    kernel_archs=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
    ptx_archs=("compute_90",), distributed_available=True,
    distributed_backends=("nccl", "gloo"), packages={"torchvision": "0.16.1"},
)


def gpu(base: Device, index: int, **changes: object) -> Device:
    """A copy of `base` as another device of the host."""
    return replace(base, index=index, uuid=f"{base.uuid}-{index}", **changes)


def requirement(spec: str = "", config: str = "", *, gpus: int = 1, min_memory_mib: int = 0,
                facts: ClientFacts = CUDA_FACTS) -> Requirement:
    return Requirement(
        gpus=gpus,
        min_memory_mib=min_memory_mib,
        spec=parse_runtime_spec(spec, "runtime-spec.yaml") if spec else None,
        config=parse_accelerator_config(config, "accelerator-config.yaml") if config else None,
        facts=facts,
    )
