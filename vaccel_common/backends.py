"""The backend table: what each torch backend needs in the environment of a process
that uses a lease. This and vaccel.accelerator are the only places of the client that
name vendor runtimes.
"""

from __future__ import annotations

import os
import stat

from vaccel_common.record import record

TYPE_CHECKING = False  # typing.TYPE_CHECKING's value: the quick `vaccel run` imports this, without typing

if TYPE_CHECKING:
    from vaccel_common.v1 import broker_pb2 as pb


@record
class ContainerFacts:
    """How a container engine is handed one backend's devices (client/vaccel/containers/engine_command.py
    applies these; it names no vendor itself). A simulated device gets its `device_nodes`
    whatever its backend: there is no real device for a vendor's toolkit to find."""

    # Docker gives the devices with `--gpus "device=ID,..."`: a device driver that the vendor's
    # container toolkit registers with dockerd. False: Docker gets the device nodes.
    docker_gpus: bool = False
    # The CDI kind that names one device by UUID (`--device KIND=UUID`, podman's way); "" none.
    cdi_kind: str = ""
    # Nodes every container of this backend needs besides each device's own nodes.
    shared_nodes: tuple[str, ...] = ()
    # The vendor container runtime's own selection variable, read from the container's
    # environment (a vendor base image sets it to "all"): vaccel sets it to the leased ids.
    runtime_visible_var: str = ""
    # The node each device a container runtime gives a container shows up as, one per device
    # (a glob): inside a container, those are the devices it was given.
    device_node_glob: str = ""


@record
class Backend:
    name: str  # cuda | rocm | xpu | cpu
    visible_devices_vars: tuple[str, ...]  # each gets the comma-joined device ids
    extra_env: tuple[tuple[str, str], ...]  # fixed variables, e.g. the device order
    allocator_var: str  # torch's memory-pool setting, "" where torch has none
    torch_device_type: str  # the torch.device type: ROCm is torch's cuda type
    dist_backend: str  # torch.distributed backend for multi-rank jobs
    # Variables that number devices within what the first filter left (0..n-1).
    renumbered_vars: tuple[str, ...] = ()
    # The accelerator-config.yaml section whose memory settings apply to this backend ("" none).
    memory_section: str = ""
    # What turns on unified (demand-paged) memory for use_unified_memory: true.
    unified_memory_env: tuple[tuple[str, str], ...] = ()
    container: ContainerFacts = ContainerFacts()


BACKENDS: dict[str, Backend] = {
    "cuda": Backend(
        name="cuda",
        visible_devices_vars=("CUDA_VISIBLE_DEVICES",),
        # NVML numbers devices by PCI bus id; make the runtime agree.
        extra_env=(("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),),
        allocator_var="PYTORCH_CUDA_ALLOC_CONF",
        torch_device_type="cuda",
        dist_backend="nccl",
        container=ContainerFacts(docker_gpus=True, cdi_kind="nvidia.com/gpu",
                                 runtime_visible_var="NVIDIA_VISIBLE_DEVICES", device_node_glob="/dev/nvidia[0-9]*"),
    ),
    "rocm": Backend(
        name="rocm",
        # ROCR filters first and HIP numbers within what is left: the ids go to ROCR,
        # and HIP sees the leased devices as 0..n-1 (same ids in both would hide them).
        visible_devices_vars=("ROCR_VISIBLE_DEVICES",),
        renumbered_vars=("HIP_VISIBLE_DEVICES",),
        extra_env=(),
        allocator_var="PYTORCH_HIP_ALLOC_CONF",
        torch_device_type="cuda",
        dist_backend="nccl",
        memory_section="rocm_config",
        # XNACK lets the GPU retry a page fault, so managed and host memory migrate on use.
        unified_memory_env=(("HSA_XNACK", "1"),),
        # the compute interface every process opens, beside the device's own render node
        container=ContainerFacts(shared_nodes=("/dev/kfd",), device_node_glob="/dev/dri/renderD*"),
    ),
    "xpu": Backend(
        name="xpu",
        visible_devices_vars=("ZE_AFFINITY_MASK",),
        # Number devices by PCI order like the probe does, and a multi-tile card as one device.
        extra_env=(("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1"), ("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")),
        allocator_var="",
        torch_device_type="xpu",
        dist_backend="xccl",
        container=ContainerFacts(device_node_glob="/dev/dri/renderD*"),
    ),
    "cpu": Backend(
        name="cpu",
        visible_devices_vars=(),
        # A CPU lease must not leave the host's GPUs visible: hide them from every runtime.
        extra_env=(("CUDA_VISIBLE_DEVICES", "-1"), ("HIP_VISIBLE_DEVICES", "-1"), ("ROCR_VISIBLE_DEVICES", "-1")),
        allocator_var="",
        torch_device_type="cpu",
        dist_backend="gloo",
    ),
}

# Other names users write for a backend (accelerator-config.yaml `backend:`).
BACKEND_ALIASES: dict[str, str] = {"oneapi": "xpu"}

# Which backend drives a device file a scheduler hands a job (Slurm's gres.conf File=).
# Slurm sets every vendor's visible-devices variable alike, so the file is what tells.
# A character major the driver owns alone; the shared DRM render nodes (major 226) by the
# PCI vendor id sysfs shows for them.
DEVICE_MAJOR_BACKENDS: dict[int, str] = {195: "cuda"}
_DRM_MAJOR = 226
PCI_VENDOR_BACKENDS: dict[str, str] = {"0x10de": "cuda", "0x1002": "rocm", "0x8086": "xpu"}
# gres.conf `AutoDetect=` values: the vendor library Slurm found the GPUs with.
GRES_AUTODETECT_BACKENDS: dict[str, str] = {"nvml": "cuda", "rsmi": "rocm", "oneapi": "xpu"}


def backend_of_device_file(path: str) -> str:
    """The backend of the device behind a device file, "" when the file says nothing."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    if not stat.S_ISCHR(st.st_mode):
        return ""
    major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
    if major == _DRM_MAJOR:
        try:
            with open(f"/sys/dev/char/{major}:{minor}/device/vendor") as f:
                return PCI_VENDOR_BACKENDS.get(f.read().strip().lower(), "")
        except OSError:
            return ""
    return DEVICE_MAJOR_BACKENDS.get(major, "")

# Device nodes of every vendor's GPUs: a container may be given them only through its lease.
GPU_NODE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/dri", "/dev/dri/*", "/dev/kfd")
# CDI kinds that name GPUs: a container may be given them only through its lease.
GPU_CDI_KINDS = tuple(sorted({"amd.com/gpu", "intel.com/gpu", "nvidia.com/gpu"}))
# What a vendor's runtime_visible_var holds when the lease has none of its devices: the
# toolkit then leaves the container as plain runc would ("none" would still mount the driver).
RUNTIME_VISIBLE_NONE = "void"


def is_gpu_node(path: str) -> bool:
    """Whether a path names a GPU's device node (or /dev/dri): by its name, or, for a node under
    another name or a symlink, by the character major that only GPU drivers own."""
    real = os.path.realpath(path)
    # Every glob is under /dev: a volume elsewhere needs no fnmatch (nor its re, ~3 ms of a
    # quick container run that mounts one).
    named = [p for p in (os.path.normpath(path), real) if p.startswith("/dev/")]
    if named:
        import fnmatch

        if any(fnmatch.fnmatchcase(p, g) for p in named for g in GPU_NODE_GLOBS):
            return True
    try:
        st = os.stat(real)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev) in DEVICE_MAJOR_BACKENDS
                                         or os.major(st.st_rdev) == _DRM_MAJOR)


def devices_given(root: str = "/") -> list[tuple[str, str]]:
    """(node, backend) of every GPU a container runtime gave this container, as its nodes show
    them (`root`: where /dev is, for tests), in the order of their names."""
    import glob

    found: dict[str, str] = {}
    for b in BACKENDS.values():
        pattern = b.container.device_node_glob
        for node in sorted(glob.glob(os.path.join(root, pattern.lstrip("/")))) if pattern else ():
            if node not in found and backend_of_device_file(node) == b.name:
                found[node] = b.name
    return sorted(found.items(), key=lambda item: _natural(item[0]))


def _natural(path: str) -> tuple[str, int]:
    """/dev/nvidia2 before /dev/nvidia10."""
    head = path.rstrip("0123456789")
    return head, int(path[len(head):] or 0)


def container_runtime_env(backend_name: str, device_ids: list[str], simulated: bool) -> dict[str, str]:
    """Every vendor container runtime's selection variable for a container of this lease: the
    leased ids for the lease's own (real) backend, nothing for all the others."""
    own = "" if simulated else backend_name
    return {b.container.runtime_visible_var: ",".join(device_ids) if b.name == own else RUNTIME_VISIBLE_NONE
            for b in BACKENDS.values() if b.container.runtime_visible_var}


# The variables that choose which devices a runtime sees (a lease sets them; nothing else may).
VISIBLE_DEVICE_VARS = frozenset(
    var for b in BACKENDS.values()
    for var in (*b.visible_devices_vars, *b.renumbered_vars, b.container.runtime_visible_var) if var)

# Every variable any backend may set, so a lease can clear what another backend left.
DEVICE_ENV_VARS = tuple(sorted({
    var
    for b in BACKENDS.values()
    for var in (*b.visible_devices_vars, *b.renumbered_vars, *(k for k, _ in b.extra_env), b.allocator_var)
    if var
}))


def backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}") from None


# What a device runtime's own context takes of a process's device memory, outside its
# allocator (CUDA's context with lazy module loading is a few hundred MiB): the allocator
# of a memory share is capped this much below the share, at most a quarter of it. An
# estimate, not measured on every GPU: scripts/gpu_check.sh prints what one takes.
SHARE_CONTEXT_RESERVE_MIB = 768
# The caching allocator frees cached blocks once it holds this fraction of its cap.
SHARE_ALLOCATOR_CONFIG = "garbage_collection_threshold:0.8"


def share_cap_mib(share_mib: int) -> int:
    """The allocator cap of a process holding a memory share of `share_mib` MiB."""
    return share_mib - min(SHARE_CONTEXT_RESERVE_MIB, share_mib // 4)


def lease_env(
    *,
    lease_id: str,
    backend_name: str,
    device_ids: list[str],
    allocator_config: str = "",
    memory_cap_mib: int = 0,
    simulated: bool = False,
    memory_pool_mib: int = 0,
    unified_memory: bool = False,
    share_mib: int = 0,
) -> dict[str, str]:
    """The variables a lease applies before any device runtime starts.

    `device_ids` are the devices' visible ids as the daemon sends them: UUIDs where the
    runtime accepts them (order-proof), per-vendor ordinals where it does not.
    `memory_pool_mib` and `unified_memory` are the accelerator config's memory section
    (see `memory_settings`); they apply only to the backend that section names: the pool
    bounds the caching allocator (the per-process cap, the smaller of it and the daemon's),
    unified memory sets the backend's `unified_memory_env`.

    `share_mib`: the lease is a memory share of one shared device (docs/sharing.md), whose
    id the visible-devices variable takes like any device's (a MIG instance's is its MIG-
    uuid). The allocator is capped below the share by the runtime's own context (the
    broker measures a process's whole use against the share), and told to give cached
    blocks back before it reaches its cap, so what the broker measures stays within it.
    """
    b = backend(backend_name)
    env: dict[str, str] = {
        "VACCEL_LEASE_ID": lease_id,
        "VACCEL_BACKEND": b.name,
        "VACCEL_DEVICES": ",".join(device_ids),
    }
    joined = ",".join(device_ids)
    for var in b.visible_devices_vars:
        env[var] = joined
    for var in b.renumbered_vars:
        env[var] = ",".join(str(i) for i in range(len(device_ids)))
    env.update(dict(b.extra_env))
    if share_mib:
        memory_cap_mib = min(memory_cap_mib or share_mib, share_cap_mib(share_mib))
        env["VACCEL_MEMORY_SHARE_MIB"] = str(share_mib)
        if "garbage_collection_threshold" not in allocator_config:
            allocator_config = ",".join(filter(None, (allocator_config, SHARE_ALLOCATOR_CONFIG)))
    if allocator_config and b.allocator_var:
        env[b.allocator_var] = allocator_config
    if b.memory_section and memory_pool_mib:
        memory_cap_mib = min(memory_cap_mib, memory_pool_mib) if memory_cap_mib else memory_pool_mib
    if b.memory_section and unified_memory:
        env.update(dict(b.unified_memory_env))
    if memory_cap_mib:
        env["VACCEL_MEMORY_CAP_MIB"] = str(memory_cap_mib)
    if simulated:
        env["VACCEL_SIMULATED"] = "1"
    return env


def memory_settings(accelerator_config_yaml: str, backend_name: str) -> tuple[int, bool]:
    """(memory_pool_mib, unified_memory) of an accelerator config's memory section for
    `backend_name`'s leases; (0, False) when the config has none or it names another
    backend. The daemon validated the text before granting; here it is only read."""
    section = BACKENDS[backend_name].memory_section if backend_name in BACKENDS else ""
    if not accelerator_config_yaml or not section:
        return 0, False
    import yaml  # only for a lease that brings a config: `vaccel run` starts without it

    document = yaml.safe_load(accelerator_config_yaml)
    settings = document.get(section) if isinstance(document, dict) else None
    if not isinstance(settings, dict):
        return 0, False
    pool = settings.get("memory_pool_size_mb") or 0
    return int(pool), settings.get("use_unified_memory") is True


def granted_env(msg: pb.Lease, memory: tuple[int, bool] | None = None) -> dict[str, str]:
    """`lease_env` of a granted lease message: what the client's Lease applies
    (vaccel/session/lease.py), and what the broker sends a ready-made `vaccel run`
    (brokerd/edge/views.py), computed once here for both. `memory`: the config's
    memory_settings when the caller has them already (the broker parsed the config off its
    loop), else they are read from the config's text here."""
    pool_mib, unified_memory = memory if memory is not None else \
        memory_settings(msg.accelerator_config_yaml, msg.backend)
    return lease_env(
        lease_id=msg.id,
        backend_name=msg.backend,
        device_ids=[d.visible_id or d.uuid for d in msg.devices],
        allocator_config=msg.allocator_config,
        memory_cap_mib=msg.memory_cap_mib,
        simulated=msg.simulated,
        memory_pool_mib=pool_mib,
        unified_memory=unified_memory,
        share_mib=msg.share_mib,
    )
