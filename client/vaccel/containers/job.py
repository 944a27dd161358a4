"""Inside a container or pod that its runtime gave GPUs and that reaches no broker, those GPUs
are the lease, as inside a Slurm job (slurm_job.py).

A plain `docker run --gpus 1 IMAGE`, a Kubernetes pod that asks for a GPU resource: the container
runtime already chose the GPUs, exclusively or not, and mounted only their nodes; there is no
broker to ask (none inside the container, the host's socket not mounted). So `lease()`,
`vaccel run` and `init_accelerator()` take the GPUs the container was given as the lease, at
once, with nothing to heartbeat and nothing to release:

    lease id    container-<hostname> (Docker: the container's short id; Kubernetes: the pod's name)
    devices     the GPU nodes in /dev, one per device (vaccel_common/backends.py knows each
                vendor's), in the order the runtime numbers them
    uuids       the vendor runtime's selection variable where it lists them (a Kubernetes
                device plugin sets it), else the node's path
    simulated   when a node has no driver behind it: the accelerator computes on the CPU

A contract cannot be checked without a broker (its probes do the checks): the lease says so,
as a warning. A container started by `vaccel run` has VACCEL_LEASE_ID and the broker's socket:
it joins that lease instead. VACCEL_CONTAINER=off turns this off.
"""

from __future__ import annotations

import os
import socket as socket_module
from collections.abc import Mapping

from vaccel.session.lease import Lease, LeaseError
from vaccel.slurm.job import check_contract, no_driver
from vaccel_common.backends import RUNTIME_VISIBLE_NONE, backend, devices_given
from vaccel_common.v1 import broker_pb2 as pb

# What container runtimes leave for the processes inside: Docker's /.dockerenv, podman's
# /run/.containerenv, Kubernetes' service variables, the `container` variable of podman and
# systemd-nspawn.
_MARK_FILES = ("/.dockerenv", "/run/.containerenv")
_MARK_VARS = ("KUBERNETES_SERVICE_HOST", "container")
_cache: dict[int, Lease | None] = {}
PREFIX = "container-"  # of the lease's id: a `vaccel run` child inherits it, and takes the same lease


def in_container(env: Mapping[str, str] = os.environ, root: str = "/") -> bool:
    """Whether this process runs in a container (and VACCEL_CONTAINER is not "off")."""
    if env.get("VACCEL_CONTAINER", "").lower() == "off":
        return False
    return (any(env.get(var) for var in _MARK_VARS)
            or any(os.path.exists(os.path.join(root, path.lstrip("/"))) for path in _MARK_FILES))


def _reaches_broker(path: str) -> bool:
    probe = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def container_lease(socket: str | os.PathLike[str] | None = None, env: Mapping[str, str] = os.environ,
                    root: str = "/") -> Lease | None:
    """The GPUs this container was given, as a Lease (cached per process); None outside a
    container, in one started by `vaccel run` (it joins that lease), one that reaches a broker,
    or one given no GPU."""
    inherited = env.get("VACCEL_LEASE_ID", "")
    if not in_container(env, root) or (inherited and not inherited.startswith(PREFIX)):
        return None
    if os.getpid() not in _cache:
        from vaccel_common.paths import client_socket

        given = devices_given(root)
        reached = bool(given) and _reaches_broker(client_socket(str(socket) if socket else None))
        _cache[os.getpid()] = _build(given, env) if given and not reached else None
    return _cache[os.getpid()]


def lease_for(gpus: int, *, contract: str | os.PathLike[str] | None, config: str | os.PathLike[str] | None,
              socket: str | os.PathLike[str] | None, in_process: bool) -> Lease | None:
    """What `lease()` and `vaccel run` get in such a container: its lease once it is known to fit
    (`gpus` at most what it was given, the contract said unchecked); None elsewhere."""
    held = container_lease(socket)
    if held is None:
        return None
    if gpus > len(held.devices):
        raise LeaseError(f"this container was given {len(held.devices)} GPU(s) and {gpus} were asked for, and no "
                         "vaccel broker is reachable from it: start it with more (docker run --gpus N, a pod's "
                         "GPU resource limit), or with `vaccel run` on the host", code="container_too_few_gpus")
    check_contract(held, contract, config, socket, in_process)
    return held


def _build(given: list[tuple[str, str]], env: Mapping[str, str]) -> Lease:
    names = {name for _, name in given}
    name = env.get("VACCEL_BACKEND", "") or (names.pop() if len(names) == 1 else "")
    if not name:
        raise LeaseError("this container was given GPUs of more than one kind: set VACCEL_BACKEND to the one to "
                         "use (one of the backend names of vaccel_common/backends.py)", code="container_backend")
    b = backend(name)
    nodes = [node for node, of in given if of == b.name]
    # Inside a container the runtime numbers what it gave from 0; a variable set already wins.
    shown = env.get(b.visible_devices_vars[0], "") if b.visible_devices_vars else ""
    ids = [i for i in shown.split(",") if i] or [str(n) for n in range(len(nodes))]
    listed = [u for u in env.get(b.container.runtime_visible_var, "").split(",") if u]
    uuids = listed if len(listed) == len(nodes) and not set(listed) & {"all", "none", RUNTIME_VISIBLE_NONE} else nodes
    simulated = any(no_driver(node) for node in nodes)
    msg = pb.Lease(id=f"{PREFIX}{socket_module.gethostname()}", backend=b.name, simulated=simulated, state="active")
    for index, (node, uuid, visible) in enumerate(zip(nodes, uuids, ids, strict=False)):
        msg.devices.add(index=index, uuid=uuid, name=os.path.basename(node), backend=b.name, simulated=simulated,
                        visible_id=visible, healthy=True, device_nodes=[node])
    return Lease(msg, joined=False)
