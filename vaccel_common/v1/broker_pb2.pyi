from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Holder(_message.Message):
    __slots__ = ("user", "uid", "pid", "command", "container")
    USER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    user: str
    uid: int
    pid: int
    command: str
    container: ContainerHolder
    def __init__(self, user: _Optional[str] = ..., uid: _Optional[int] = ..., pid: _Optional[int] = ..., command: _Optional[str] = ..., container: _Optional[_Union[ContainerHolder, _Mapping]] = ...) -> None: ...

class ContainerHolder(_message.Message):
    __slots__ = ("id", "name", "image", "engine")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    image: str
    engine: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., image: _Optional[str] = ..., engine: _Optional[str] = ...) -> None: ...

class AttachContainerRequest(_message.Message):
    __slots__ = ("lease_id", "container_id", "init_pid", "held", "warn_signal", "name", "image", "starting")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    INIT_PID_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    WARN_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    container_id: str
    init_pid: int
    held: bool
    warn_signal: int
    name: str
    image: str
    starting: bool
    def __init__(self, lease_id: _Optional[str] = ..., container_id: _Optional[str] = ..., init_pid: _Optional[int] = ..., held: _Optional[bool] = ..., warn_signal: _Optional[int] = ..., name: _Optional[str] = ..., image: _Optional[str] = ..., starting: _Optional[bool] = ...) -> None: ...

class Device(_message.Message):
    __slots__ = ("index", "uuid", "vendor", "name", "memory_mib", "pci_bus_id", "arch", "driver_version", "memory_bandwidth_gbps", "healthy", "health_reason", "simulated", "numa_node", "backend", "state", "lease_id", "holder", "since", "memory_used_mib", "interconnect_group", "runtime_version", "compute_capability", "visible_id", "drain_reason", "gated", "time_left_s", "device_nodes", "utilization", "gate_reason", "label", "mig_index", "parent_uuid", "mig_profile", "sharing", "shares", "busy_by", "borrowed")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    VENDOR_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    PCI_BUS_ID_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    HEALTH_REASON_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MIB_FIELD_NUMBER: _ClassVar[int]
    INTERCONNECT_GROUP_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    GATED_FIELD_NUMBER: _ClassVar[int]
    TIME_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NODES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    GATE_REASON_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    MIG_INDEX_FIELD_NUMBER: _ClassVar[int]
    PARENT_UUID_FIELD_NUMBER: _ClassVar[int]
    MIG_PROFILE_FIELD_NUMBER: _ClassVar[int]
    SHARING_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    BUSY_BY_FIELD_NUMBER: _ClassVar[int]
    BORROWED_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    vendor: str
    name: str
    memory_mib: int
    pci_bus_id: str
    arch: str
    driver_version: str
    memory_bandwidth_gbps: float
    healthy: bool
    health_reason: str
    simulated: bool
    numa_node: int
    backend: str
    state: str
    lease_id: str
    holder: Holder
    since: float
    memory_used_mib: int
    interconnect_group: str
    runtime_version: str
    compute_capability: str
    visible_id: str
    drain_reason: str
    gated: bool
    time_left_s: float
    device_nodes: _containers.RepeatedScalarFieldContainer[str]
    utilization: float
    gate_reason: str
    label: str
    mig_index: int
    parent_uuid: str
    mig_profile: str
    sharing: str
    shares: _containers.RepeatedCompositeFieldContainer[Share]
    busy_by: BusyBy
    borrowed: bool
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., vendor: _Optional[str] = ..., name: _Optional[str] = ..., memory_mib: _Optional[int] = ..., pci_bus_id: _Optional[str] = ..., arch: _Optional[str] = ..., driver_version: _Optional[str] = ..., memory_bandwidth_gbps: _Optional[float] = ..., healthy: _Optional[bool] = ..., health_reason: _Optional[str] = ..., simulated: _Optional[bool] = ..., numa_node: _Optional[int] = ..., backend: _Optional[str] = ..., state: _Optional[str] = ..., lease_id: _Optional[str] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ..., since: _Optional[float] = ..., memory_used_mib: _Optional[int] = ..., interconnect_group: _Optional[str] = ..., runtime_version: _Optional[str] = ..., compute_capability: _Optional[str] = ..., visible_id: _Optional[str] = ..., drain_reason: _Optional[str] = ..., gated: _Optional[bool] = ..., time_left_s: _Optional[float] = ..., device_nodes: _Optional[_Iterable[str]] = ..., utilization: _Optional[float] = ..., gate_reason: _Optional[str] = ..., label: _Optional[str] = ..., mig_index: _Optional[int] = ..., parent_uuid: _Optional[str] = ..., mig_profile: _Optional[str] = ..., sharing: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[Share, _Mapping]]] = ..., busy_by: _Optional[_Union[BusyBy, _Mapping]] = ..., borrowed: _Optional[bool] = ...) -> None: ...

class Share(_message.Message):
    __slots__ = ("lease_id", "user", "uid", "memory_mib", "used_mib", "since")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    USED_MIB_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    user: str
    uid: int
    memory_mib: int
    used_mib: int
    since: float
    def __init__(self, lease_id: _Optional[str] = ..., user: _Optional[str] = ..., uid: _Optional[int] = ..., memory_mib: _Optional[int] = ..., used_mib: _Optional[int] = ..., since: _Optional[float] = ...) -> None: ...

class ClientFacts(_message.Message):
    __slots__ = ("python_version", "torch_version", "torch_backend", "torch_runtime_version", "kernel_archs", "ptx_archs", "distributed_available", "distributed_backends", "packages", "python_executable")
    class PackagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TORCH_RUNTIME_VERSION_FIELD_NUMBER: _ClassVar[int]
    KERNEL_ARCHS_FIELD_NUMBER: _ClassVar[int]
    PTX_ARCHS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTED_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTED_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    PYTHON_EXECUTABLE_FIELD_NUMBER: _ClassVar[int]
    python_version: str
    torch_version: str
    torch_backend: str
    torch_runtime_version: str
    kernel_archs: _containers.RepeatedScalarFieldContainer[str]
    ptx_archs: _containers.RepeatedScalarFieldContainer[str]
    distributed_available: bool
    distributed_backends: _containers.RepeatedScalarFieldContainer[str]
    packages: _containers.ScalarMap[str, str]
    python_executable: str
    def __init__(self, python_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., torch_backend: _Optional[str] = ..., torch_runtime_version: _Optional[str] = ..., kernel_archs: _Optional[_Iterable[str]] = ..., ptx_archs: _Optional[_Iterable[str]] = ..., distributed_available: _Optional[bool] = ..., distributed_backends: _Optional[_Iterable[str]] = ..., packages: _Optional[_Mapping[str, str]] = ..., python_executable: _Optional[str] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("gpus", "min_memory_mib", "max_wait_seconds", "wait_forever", "runtime_spec_yaml", "runtime_spec_name", "accelerator_config_yaml", "accelerator_config_name", "client", "command", "request_key", "time_limit_s", "devices", "reservation", "memory_mib")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    MIN_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOREVER_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_SPEC_NAME_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KEY_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    gpus: int
    min_memory_mib: int
    max_wait_seconds: float
    wait_forever: bool
    runtime_spec_yaml: str
    runtime_spec_name: str
    accelerator_config_yaml: str
    accelerator_config_name: str
    client: ClientFacts
    command: str
    request_key: str
    time_limit_s: float
    devices: _containers.RepeatedScalarFieldContainer[str]
    reservation: bool
    memory_mib: int
    def __init__(self, gpus: _Optional[int] = ..., min_memory_mib: _Optional[int] = ..., max_wait_seconds: _Optional[float] = ..., wait_forever: _Optional[bool] = ..., runtime_spec_yaml: _Optional[str] = ..., runtime_spec_name: _Optional[str] = ..., accelerator_config_yaml: _Optional[str] = ..., accelerator_config_name: _Optional[str] = ..., client: _Optional[_Union[ClientFacts, _Mapping]] = ..., command: _Optional[str] = ..., request_key: _Optional[str] = ..., time_limit_s: _Optional[float] = ..., devices: _Optional[_Iterable[str]] = ..., reservation: _Optional[bool] = ..., memory_mib: _Optional[int] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("position", "total", "message", "held", "request_id")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    position: int
    total: int
    message: str
    held: _containers.RepeatedCompositeFieldContainer[Device]
    request_id: str
    def __init__(self, position: _Optional[int] = ..., total: _Optional[int] = ..., message: _Optional[str] = ..., held: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., request_id: _Optional[str] = ...) -> None: ...

class CheckLine(_message.Message):
    __slots__ = ("level", "name", "message", "device_uuid", "suggestion")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    SUGGESTION_FIELD_NUMBER: _ClassVar[int]
    level: str
    name: str
    message: str
    device_uuid: str
    suggestion: str
    def __init__(self, level: _Optional[str] = ..., name: _Optional[str] = ..., message: _Optional[str] = ..., device_uuid: _Optional[str] = ..., suggestion: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("id", "backend", "devices", "holder", "granted_at", "expires_at", "heartbeat_interval_s", "ttl_s", "state", "end_reason", "allocator_config", "memory_cap_mib", "warnings", "member_pids", "simulated", "accelerator_config_yaml", "ended_at", "reservation", "requested_at", "notice", "time_limit_s", "slurm_job_id", "share_mib", "borrowed")
    ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    GRANTED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    ALLOCATOR_CONFIG_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAP_MIB_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_PIDS_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    SLURM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SHARE_MIB_FIELD_NUMBER: _ClassVar[int]
    BORROWED_FIELD_NUMBER: _ClassVar[int]
    id: str
    backend: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    holder: Holder
    granted_at: float
    expires_at: float
    heartbeat_interval_s: float
    ttl_s: float
    state: str
    end_reason: str
    allocator_config: str
    memory_cap_mib: int
    warnings: _containers.RepeatedCompositeFieldContainer[CheckLine]
    member_pids: _containers.RepeatedScalarFieldContainer[int]
    simulated: bool
    accelerator_config_yaml: str
    ended_at: float
    reservation: bool
    requested_at: float
    notice: str
    time_limit_s: float
    slurm_job_id: int
    share_mib: int
    borrowed: bool
    def __init__(self, id: _Optional[str] = ..., backend: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., holder: _Optional[_Union[Holder, _Mapping]] = ..., granted_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., ttl_s: _Optional[float] = ..., state: _Optional[str] = ..., end_reason: _Optional[str] = ..., allocator_config: _Optional[str] = ..., memory_cap_mib: _Optional[int] = ..., warnings: _Optional[_Iterable[_Union[CheckLine, _Mapping]]] = ..., member_pids: _Optional[_Iterable[int]] = ..., simulated: _Optional[bool] = ..., accelerator_config_yaml: _Optional[str] = ..., ended_at: _Optional[float] = ..., reservation: _Optional[bool] = ..., requested_at: _Optional[float] = ..., notice: _Optional[str] = ..., time_limit_s: _Optional[float] = ..., slurm_job_id: _Optional[int] = ..., share_mib: _Optional[int] = ..., borrowed: _Optional[bool] = ...) -> None: ...

class AcquireUpdate(_message.Message):
    __slots__ = ("queued", "granted")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    queued: Queued
    granted: Lease
    def __init__(self, queued: _Optional[_Union[Queued, _Mapping]] = ..., granted: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class LeaseRef(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("ttl_s", "expires_at", "notice")
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    expires_at: float
    notice: str
    def __init__(self, ttl_s: _Optional[float] = ..., expires_at: _Optional[float] = ..., notice: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "reason", "grace_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    reason: str
    grace_s: float
    def __init__(self, lease_id: _Optional[str] = ..., reason: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("all", "include_ended")
    ALL_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ENDED_FIELD_NUMBER: _ClassVar[int]
    all: bool
    include_ended: bool
    def __init__(self, all: _Optional[bool] = ..., include_ended: _Optional[bool] = ...) -> None: ...

class ListLeasesReply(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("device", "undo", "reason")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    device: str
    undo: bool
    reason: str
    def __init__(self, device: _Optional[str] = ..., undo: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class QueueEntry(_message.Message):
    __slots__ = ("request_id", "requester", "gpus", "min_memory_mib", "since", "position", "reason", "time_limit_s", "devices", "slurm_job_id", "memory_mib")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    MIN_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    SLURM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    requester: Holder
    gpus: int
    min_memory_mib: int
    since: float
    position: int
    reason: str
    time_limit_s: float
    devices: _containers.RepeatedScalarFieldContainer[str]
    slurm_job_id: int
    memory_mib: int
    def __init__(self, request_id: _Optional[str] = ..., requester: _Optional[_Union[Holder, _Mapping]] = ..., gpus: _Optional[int] = ..., min_memory_mib: _Optional[int] = ..., since: _Optional[float] = ..., position: _Optional[int] = ..., reason: _Optional[str] = ..., time_limit_s: _Optional[float] = ..., devices: _Optional[_Iterable[str]] = ..., slurm_job_id: _Optional[int] = ..., memory_mib: _Optional[int] = ...) -> None: ...

class GpuProcess(_message.Message):
    __slots__ = ("pid", "uid", "user", "command", "used_memory_mib", "device_uuid", "lease_id")
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    USED_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    uid: int
    user: str
    command: str
    used_memory_mib: int
    device_uuid: str
    lease_id: str
    def __init__(self, pid: _Optional[int] = ..., uid: _Optional[int] = ..., user: _Optional[str] = ..., command: _Optional[str] = ..., used_memory_mib: _Optional[int] = ..., device_uuid: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ProbeVerdict(_message.Message):
    __slots__ = ("vendor", "available", "reason")
    VENDOR_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    vendor: str
    available: bool
    reason: str
    def __init__(self, vendor: _Optional[str] = ..., available: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("hostname", "devices", "queue", "unleased_processes", "probes", "version", "simulated", "enforcement", "usage", "slurm_mode", "stopped_containers")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    UNLEASED_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIMULATED_FIELD_NUMBER: _ClassVar[int]
    ENFORCEMENT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SLURM_MODE_FIELD_NUMBER: _ClassVar[int]
    STOPPED_CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    queue: _containers.RepeatedCompositeFieldContainer[QueueEntry]
    unleased_processes: _containers.RepeatedCompositeFieldContainer[GpuProcess]
    probes: _containers.RepeatedCompositeFieldContainer[ProbeVerdict]
    version: str
    simulated: bool
    enforcement: str
    usage: _containers.RepeatedCompositeFieldContainer[UserUsage]
    slurm_mode: str
    stopped_containers: _containers.RepeatedCompositeFieldContainer[ContainerStop]
    def __init__(self, hostname: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., queue: _Optional[_Iterable[_Union[QueueEntry, _Mapping]]] = ..., unleased_processes: _Optional[_Iterable[_Union[GpuProcess, _Mapping]]] = ..., probes: _Optional[_Iterable[_Union[ProbeVerdict, _Mapping]]] = ..., version: _Optional[str] = ..., simulated: _Optional[bool] = ..., enforcement: _Optional[str] = ..., usage: _Optional[_Iterable[_Union[UserUsage, _Mapping]]] = ..., slurm_mode: _Optional[str] = ..., stopped_containers: _Optional[_Iterable[_Union[ContainerStop, _Mapping]]] = ...) -> None: ...

class BusyBy(_message.Message):
    __slots__ = ("user", "pid", "command", "container")
    USER_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    user: str
    pid: int
    command: str
    container: str
    def __init__(self, user: _Optional[str] = ..., pid: _Optional[int] = ..., command: _Optional[str] = ..., container: _Optional[str] = ...) -> None: ...

class ContainerStop(_message.Message):
    __slots__ = ("engine", "id", "name", "image", "reason", "at", "lease_id", "user")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    engine: str
    id: str
    name: str
    image: str
    reason: str
    at: float
    lease_id: str
    user: str
    def __init__(self, engine: _Optional[str] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., image: _Optional[str] = ..., reason: _Optional[str] = ..., at: _Optional[float] = ..., lease_id: _Optional[str] = ..., user: _Optional[str] = ...) -> None: ...

class UserUsage(_message.Message):
    __slots__ = ("user", "uid", "policy", "devices_held", "max_devices", "waiting", "max_waiting", "device_hours", "max_device_hours", "window_s", "fair_usage")
    USER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DEVICES_HELD_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HOURS_FIELD_NUMBER: _ClassVar[int]
    MAX_DEVICE_HOURS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    FAIR_USAGE_FIELD_NUMBER: _ClassVar[int]
    user: str
    uid: int
    policy: str
    devices_held: int
    max_devices: int
    waiting: int
    max_waiting: int
    device_hours: float
    max_device_hours: float
    window_s: float
    fair_usage: float
    def __init__(self, user: _Optional[str] = ..., uid: _Optional[int] = ..., policy: _Optional[str] = ..., devices_held: _Optional[int] = ..., max_devices: _Optional[int] = ..., waiting: _Optional[int] = ..., max_waiting: _Optional[int] = ..., device_hours: _Optional[float] = ..., max_device_hours: _Optional[float] = ..., window_s: _Optional[float] = ..., fair_usage: _Optional[float] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("since", "until", "by")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    since: float
    until: float
    by: str
    def __init__(self, since: _Optional[float] = ..., until: _Optional[float] = ..., by: _Optional[str] = ...) -> None: ...

class ReportRow(_message.Message):
    __slots__ = ("key", "device_hours", "leases", "wait_p50_s", "wait_p90_s", "wait_max_s", "idle_device_hours", "end_reasons", "lease", "idle_measured")
    class EndReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HOURS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    WAIT_P50_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_P90_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_MAX_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_DEVICE_HOURS_FIELD_NUMBER: _ClassVar[int]
    END_REASONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    IDLE_MEASURED_FIELD_NUMBER: _ClassVar[int]
    key: str
    device_hours: float
    leases: int
    wait_p50_s: float
    wait_p90_s: float
    wait_max_s: float
    idle_device_hours: float
    end_reasons: _containers.ScalarMap[str, int]
    lease: UsedLease
    idle_measured: bool
    def __init__(self, key: _Optional[str] = ..., device_hours: _Optional[float] = ..., leases: _Optional[int] = ..., wait_p50_s: _Optional[float] = ..., wait_p90_s: _Optional[float] = ..., wait_max_s: _Optional[float] = ..., idle_device_hours: _Optional[float] = ..., end_reasons: _Optional[_Mapping[str, int]] = ..., lease: _Optional[_Union[UsedLease, _Mapping]] = ..., idle_measured: _Optional[bool] = ...) -> None: ...

class UsedLease(_message.Message):
    __slots__ = ("user", "requested_at", "granted_at", "ended_at", "devices", "time_limit_s", "reservation", "state")
    USER_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    GRANTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    TIME_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    user: str
    requested_at: float
    granted_at: float
    ended_at: float
    devices: int
    time_limit_s: float
    reservation: bool
    state: str
    def __init__(self, user: _Optional[str] = ..., requested_at: _Optional[float] = ..., granted_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., devices: _Optional[int] = ..., time_limit_s: _Optional[float] = ..., reservation: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("since", "until", "by", "rows", "total", "rows_hidden")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROWS_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    since: float
    until: float
    by: str
    rows: _containers.RepeatedCompositeFieldContainer[ReportRow]
    total: ReportRow
    rows_hidden: bool
    def __init__(self, since: _Optional[float] = ..., until: _Optional[float] = ..., by: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[ReportRow, _Mapping]]] = ..., total: _Optional[_Union[ReportRow, _Mapping]] = ..., rows_hidden: _Optional[bool] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ("runtime_spec_yaml", "runtime_spec_name", "accelerator_config_yaml", "accelerator_config_name", "client", "gpus", "min_memory_mib")
    RUNTIME_SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_SPEC_NAME_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_CONFIG_NAME_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    MIN_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    runtime_spec_yaml: str
    runtime_spec_name: str
    accelerator_config_yaml: str
    accelerator_config_name: str
    client: ClientFacts
    gpus: int
    min_memory_mib: int
    def __init__(self, runtime_spec_yaml: _Optional[str] = ..., runtime_spec_name: _Optional[str] = ..., accelerator_config_yaml: _Optional[str] = ..., accelerator_config_name: _Optional[str] = ..., client: _Optional[_Union[ClientFacts, _Mapping]] = ..., gpus: _Optional[int] = ..., min_memory_mib: _Optional[int] = ...) -> None: ...

class DeviceCheck(_message.Message):
    __slots__ = ("device", "eligible", "checks")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    device: Device
    eligible: bool
    checks: _containers.RepeatedCompositeFieldContainer[CheckLine]
    def __init__(self, device: _Optional[_Union[Device, _Mapping]] = ..., eligible: _Optional[bool] = ..., checks: _Optional[_Iterable[_Union[CheckLine, _Mapping]]] = ...) -> None: ...

class CheckReply(_message.Message):
    __slots__ = ("satisfiable", "host_checks", "devices", "suggestions", "summary")
    SATISFIABLE_FIELD_NUMBER: _ClassVar[int]
    HOST_CHECKS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    SUGGESTIONS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    satisfiable: bool
    host_checks: _containers.RepeatedCompositeFieldContainer[CheckLine]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceCheck]
    suggestions: _containers.RepeatedScalarFieldContainer[str]
    summary: str
    def __init__(self, satisfiable: _Optional[bool] = ..., host_checks: _Optional[_Iterable[_Union[CheckLine, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[DeviceCheck, _Mapping]]] = ..., suggestions: _Optional[_Iterable[str]] = ..., summary: _Optional[str] = ...) -> None: ...
