"""Apply a lease to a container engine's `run`: the options vaccel adds after the user's.

- the leased devices, the engine's way for the lease's backend (vaccel_common/backends.py,
  ContainerFacts): Docker's `--gpus "device=UUID,..."`, a CDI name per device for podman, or
  else the device nodes (`--device`); a simulated device always its `device_nodes`;
- the broker's socket folder, bind-mounted at the same path: the folder and not the socket
  file, because a file mount keeps the old inode and a restarted broker's new socket is then
  unreachable; `--mount` and not `-v`, because `-v` makes a missing source into a directory;
- `-e` for the lease's variables as the container must see them: VACCEL_LEASE_ID and
  VACCEL_SOCKET (so `with lease()` inside joins), the visible devices (UUIDs kept; ordinals,
  which a container renumbers from 0, renumbered), the allocator settings, and every vendor
  container runtime's own selection variable (an image's `=all` overridden);
- labels `org.vaccel.lease=ID` and `org.vaccel.user=NAME`, which the broker checks with the
  engine before it counts a container as the lease's, and `org.vaccel.devices=UUID,...`, the
  devices `vaccel run -- docker start NAME` leases again (container_start.py);
- `--cidfile` (unless the user gave one), where the engine writes the container's id;
- `--init` (unless the user chose): signals reach the command as on a host, so SIGTERM at the
  lease's end stops a command that would ignore it as PID 1 and wait out the whole grace.
"""

from __future__ import annotations

import io
import os
import pwd
import threading
import time
from collections.abc import Mapping

from vaccel.containers.engine_command import ContainerRefused, ContainerRun
from vaccel_common.backends import backend, container_runtime_env
from vaccel_common.record import record

TYPE_CHECKING = False  # typing.TYPE_CHECKING's value: this module is on the quick path, without typing

if TYPE_CHECKING:
    from vaccel.session.lease import Lease

LEASE_LABEL = "org.vaccel.lease"
USER_LABEL = "org.vaccel.user"
DEVICES_LABEL = "org.vaccel.devices"  # the leased UUIDs: what `vaccel run -- docker start` leases again


@record
class LeasedDevice:
    index: int
    uuid: str
    visible_id: str  # what the backend's visible-devices variable takes on the host
    device_nodes: tuple[str, ...]


@record
class ContainerLease:
    """What of a lease a container needs (from a `vaccel.session.lease.Lease`, or a test's own)."""

    lease_id: str
    user: str
    backend: str
    simulated: bool
    devices: tuple[LeasedDevice, ...]
    env: Mapping[str, str]  # the lease's variables as a host process gets them
    socket: str  # the broker's socket

    @classmethod
    def of(cls, lease: Lease, socket: str, user: str) -> ContainerLease:
        devices = tuple(LeasedDevice(d.index, d.uuid, d.visible_id, d.device_nodes) for d in lease.devices)
        return cls(lease.id, user, lease.backend, lease.simulated, devices, dict(lease.env), os.path.abspath(socket))


def user_name() -> str:
    """This process's user, as the container's label names it."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def for_lease(run: ContainerRun, lease: Lease, socket: str, folder: str) -> tuple[list[str], str]:
    """`apply` for a granted lease of this process's user, with the
    container id to be written in `folder` (private, empty)."""
    return apply(run, ContainerLease.of(lease, socket, user_name()), os.path.join(folder, "container-id"))


def private_folder() -> str:
    """A new folder only this user may enter, for the engine's --cidfile (remove_folder removes
    it). Not tempfile's: importing it costs every container's run ~10 ms."""
    base = os.environ.get("TMPDIR") or "/tmp"
    while True:
        try:
            folder = os.path.join(base, f"vaccel-ct-{os.urandom(6).hex()}")
            os.mkdir(folder, 0o700)
            return folder
        except FileExistsError:
            continue
        except OSError:  # TMPDIR unusable: tempfile looks in the other usual places
            import tempfile

            return tempfile.mkdtemp(prefix="vaccel-ct-")


def remove_folder(folder: str) -> None:
    """Remove a private_folder and what the engine wrote in it."""
    for entry in os.scandir(folder):
        os.unlink(entry.path)
    os.rmdir(folder)


def read_id(cidfile: str) -> str:
    """The container's id its engine wrote in the --cidfile ("" until then)."""
    try:
        with open(cidfile) as f:
            return f.read().strip()
    except OSError:
        return ""


def wait_for_id(cidfile: str, done: threading.Event, longest_s: float) -> str:
    """The container's id once its engine has written it; "" when `done` is set first or
    `longest_s` passes. The engine gives no event for its --cidfile: look often at first (a
    container starts in ~0.3 s), then every 0.2 s while an image is pulled."""
    deadline = time.monotonic() + longest_s
    wait = 0.01
    while not done.wait(wait) and time.monotonic() < deadline:
        container = read_id(cidfile)
        if container:
            return container
        wait = min(0.2, wait * 1.5)
    return ""


def apply(run: ContainerRun, lease: ContainerLease, cidfile: str) -> tuple[list[str], str]:
    """The command with the lease applied, and the file the container's id will be in (the
    user's own --cidfile when they gave one, else `cidfile`, which must not exist yet)."""
    added = device_options(run.engine, lease)
    folder = os.path.dirname(lease.socket)
    added += ["--mount", _csv(["type=bind", f"src={folder}", f"dst={folder}"])]
    for name, value in sorted(container_env(lease).items()):
        added += ["-e", f"{name}={value}"]
    added += ["--label", f"{LEASE_LABEL}={lease.lease_id}", "--label", f"{USER_LABEL}={lease.user}",
              "--label", f"{DEVICES_LABEL}={','.join(d.uuid for d in lease.devices)}"]
    given = run.values("--cidfile")
    if not given:
        added += ["--cidfile", cidfile]
    if not any(run.given(name) for name in ("--init", "--init-path", "--systemd")):
        added.append("--init")
    return run.argv(added), given[-1] if given else cidfile


def device_options(engine: str, lease: ContainerLease) -> list[str]:
    facts = backend(lease.backend).container
    uuids = [d.uuid for d in lease.devices]
    if not lease.simulated and engine == "docker" and facts.docker_gpus:
        # One CSV field: the quotes keep the commas of the device list inside it.
        return ["--gpus", f'"device={",".join(uuids)}"']
    if not lease.simulated and engine == "podman" and facts.cdi_kind:
        return [word for uuid in uuids for word in ("--device", f"{facts.cdi_kind}={uuid}")]
    bare = [f"gpu{d.index}" for d in lease.devices if not d.device_nodes]
    if bare and not lease.simulated:
        raise ContainerRefused(f"cannot give {', '.join(bare)} to a {engine} container: the broker knows no device "
                               "node of it")
    nodes = [*(() if lease.simulated else facts.shared_nodes), *(n for d in lease.devices for n in d.device_nodes)]
    return [word for node in dict.fromkeys(nodes) for word in ("--device", node)]


def container_ids(devices: tuple[LeasedDevice, ...]) -> list[str]:
    """The devices' visible ids inside the container: a UUID is the same there; a host ordinal
    is not, since the container sees only the leased devices, numbered from 0 in host order."""
    rank = {d.index: n for n, d in enumerate(sorted(devices, key=lambda d: d.index))}
    return [d.visible_id if d.visible_id == d.uuid else str(rank[d.index]) for d in devices]


def container_env(lease: ContainerLease) -> dict[str, str]:
    """The lease's variables as a process in the container must get them."""
    env = dict(lease.env)
    ids = ",".join(container_ids(lease.devices))
    for var in backend(lease.backend).visible_devices_vars:
        if var in env:
            env[var] = ids
    env["VACCEL_DEVICES"] = ids
    env["VACCEL_SOCKET"] = lease.socket
    env.update(container_runtime_env(lease.backend, [d.uuid for d in lease.devices], lease.simulated))
    return env


def _csv(fields: list[str]) -> str:
    """One line of the engines' CSV option syntax (a path with a comma stays one field).
    Fields with nothing to quote are joined as they are; only the rest import csv (and re,
    ~7 ms of the quick path)."""
    if not any(char in field for field in fields for char in ',"\r\n'):
        return ",".join(fields)
    import csv

    out = io.StringIO()
    # The line's own end is cut off, not left out: csv quotes a field with a line break only
    # when its line terminator has one.
    csv.writer(out, lineterminator="\r\n").writerow(fields)
    return out.getvalue().removesuffix("\r\n")
