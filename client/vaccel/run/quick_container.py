"""`vaccel run [-q] [--gpus N] -- docker run ...` at about the engine's own cost (issue 45).

Through the full CLI, a short container's run cost 1.42x the bare `docker run`
(bench/container_overhead.py): argparse, protobuf, the runner and grpc were imported before
the engine's client could start, and the engine's client was started again after the
container's exit. Here, as vaccel/run/quick_run.py does for a plain command (and called by it):
- the command is read and checked by the container modules (vaccel/containers/engine_command.py
  and rules.py; neither needs protobuf), before anything is asked;
- the grant comes ready-made (the RunNow view), and the few facts of the lease a container
  needs (its id, backend, devices: index, UUID, visible id, nodes) are read from the grant's
  own bytes without protobuf (`container_lease`: tests/test_quick_container.py checks it
  against protobuf's reading);
- the engine's client starts with the lease applied (vaccel/containers/argv.py), and a thread
  names the container to the broker over the identity socket (AttachContainer, as
  vaccel/containers/hold.py's _Namer does: the broker confirms the container with its engine
  before the lease follows it; never on our word);
- a container that ends within the quick window gives its lease back over the identity socket;
  else the runner takes over (runner.continue_run: heartbeat, signals, the lease's end) while
  the thread goes on naming the container.
Only foreground runs that cannot be detached from (no -d, no stdin attached), of docker or of
podman as root (rootless podman's container is named by its init's pid, which its engine
reports: the full path). Anything else, and any reply this module cannot read, goes to the
full CLI, before anything is asked or with the lease given back first.
"""

import os
import sys
import threading
from collections.abc import Callable

from vaccel.containers import argv as container_argv
from vaccel.containers import rules
from vaccel.containers.engine_command import ContainerRefused, ContainerRun, recognise
from vaccel.run.forked import Forked
from vaccel.session.identity_calls import ask
from vaccel_common.paths import identity_socket
from vaccel_common.side_call import _string, _varint

QUICK_MAX_S = 2.0  # the quick window: at most this, and at most half a heartbeat interval (quick_run.py)
CREATE_WAIT_S = 3600.0  # as vaccel/containers/hold.py: an image's pull comes before the create
SETTLE_S = 2.0
WARN_SIGNAL = 10  # SIGUSR1, `vaccel run --signal`'s default: the broker warns the container's processes
_NOT_FOUND, _UNIMPLEMENTED = 5, 12


def readable(command: list[str]) -> ContainerRun | None:
    """The command as a container run this path takes; None for the full CLI (which also says
    why a run is refused)."""
    try:
        run = recognise(command)
        if run is not None:
            rules.check(run)
    except ContainerRefused:
        return None
    if run is None or run.detached or run.stdin_attached or (run.engine == "podman" and os.geteuid() != 0):
        return None
    return run


class Quick:
    """What of vaccel/run/quick_run.py this path runs (passed in: it imports this module)."""

    def __init__(self, spawn: Callable[[list[str], dict[str, str]], int], ends_quickly: Callable[[Forked, float], bool],
                 release: Callable[[str, str, bytes, str | None, bool], None]) -> None:
        self.spawn, self.ends_quickly, self.release = spawn, ends_quickly, release


def run_granted(run: ContainerRun, fields: list[bytes], env: dict[str, str], lines: list[str], path: str,
                socket_arg: str | None, quiet: bool, quick: Quick) -> int | None:
    """The rest of quick_run.run for a container, from a RunNow grant (`fields`, `env` and
    `lines` as quick_run read them); None (the lease given back) for the full CLI."""
    lease_id, granted = fields[1].decode(errors="replace"), fields[3]
    try:
        lease = container_lease(granted, dict(item.partition("=")[::2] for item in fields[4].decode().split("\0")),
                                path)
        quick_s = min(QUICK_MAX_S, float(fields[6]) / 2)
    except (ValueError, IndexError):
        quick.release(path, lease_id, granted, socket_arg, True)
        return None
    for line in lines:
        print(f"vaccel: {line}", file=sys.stderr, flush=True)
    folder = container_argv.private_folder()
    namer: _Namer | None = None
    try:
        command, cidfile = container_argv.apply(run, lease, os.path.join(folder, "container-id"))
        try:
            child = Forked(quick.spawn(command, env))
        except OSError as exc:
            print(f"vaccel: cannot run {command[0]}: {exc.strerror}", file=sys.stderr, flush=True)
            code = 127 if isinstance(exc, FileNotFoundError) else 126
        else:
            namer = _Namer(run, lease_id, cidfile, path, socket_arg)
            namer.start()
            if not quick.ends_quickly(child, quick_s):
                from vaccel.run.runner import continue_run

                # The engine's client passes signals on to the container: the warning signal is
                # the broker's to send, to the container's processes that catch it (hold.py).
                return continue_run(child, granted, socket=socket_arg, quiet=quiet, warn_signal=None)
            code = child.returncode or 0
            code = 128 - code if code < 0 else code
    finally:
        if namer is not None:
            namer.stop()
        container_argv.remove_folder(folder)
    quick.release(path, lease_id, granted, socket_arg, quiet)
    return code


# -- the grant's bytes, read without protobuf (proto/vaccel/v1/broker.proto) -------------

def _varint_at(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        if at >= len(data):
            raise ValueError("a varint runs past the message")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
    raise ValueError("a varint too long")


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """A message's (field number, value) pairs: a varint's number, a length-delimited field's bytes."""
    found: list[tuple[int, int | bytes]] = []
    at = 0
    while at < len(data):
        key, at = _varint_at(data, at)
        kind = key & 7
        if kind == 0:
            value, at = _varint_at(data, at)
            found.append((key >> 3, value))
        elif kind == 2:
            length, at = _varint_at(data, at)
            if at + length > len(data):
                raise ValueError("a field runs past the message")
            found.append((key >> 3, data[at:at + length]))
            at += length
        elif kind in (1, 5):  # fixed64 (a double), fixed32: not read here
            at += 8 if kind == 1 else 4
        else:
            raise ValueError(f"wire type {kind}")
    if at != len(data):
        raise ValueError("a fixed field runs past the message")
    return found


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ValueError("a string field that is not one")
    return value.decode()


def container_lease(update: bytes, env: dict[str, str], socket: str) -> container_argv.ContainerLease:
    """What of the granted lease in AcquireUpdate `update` a container needs, and `env`, the
    lease's variables (RunNow's). Fields: AcquireUpdate.granted = 2; Lease: id = 1, backend = 2,
    devices = 3, simulated = 15; Device: index = 1, uuid = 2, visible_id = 23, device_nodes = 27."""
    granted = [value for number, value in _fields(update) if number == 2]
    if len(granted) != 1 or not isinstance(granted[0], bytes):
        raise ValueError("not a grant")
    lease_id = backend = ""
    simulated = False
    devices = []
    for number, value in _fields(granted[0]):
        if number == 1:
            lease_id = _text(value)
        elif number == 2:
            backend = _text(value)
        elif number == 15:
            simulated = bool(value)
        elif number == 3:
            devices.append(_device(_fields(_bytes(value))))
    if not lease_id or not devices:
        raise ValueError("a grant without its id or devices")
    return container_argv.ContainerLease(lease_id, container_argv.user_name(), backend, simulated, tuple(devices),
                                         env, os.path.abspath(socket))


def _bytes(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise ValueError("a message field that is not one")
    return value


def _device(fields: list[tuple[int, int | bytes]]) -> container_argv.LeasedDevice:
    index, uuid, visible, nodes = 0, "", "", []
    for number, value in fields:
        if number == 1:
            if not isinstance(value, int):
                raise ValueError("an index that is not a number")
            index = value - (1 << 64) if value >= 1 << 63 else value  # int32: a negative one is 10 bytes
        elif number == 2:
            uuid = _text(value)
        elif number == 23:
            visible = _text(value)
        elif number == 27:
            nodes.append(_text(value))
    return container_argv.LeasedDevice(index, uuid, visible or uuid, tuple(nodes))


def attach_request(lease_id: str, container_id: str, name: str, image: str) -> bytes:
    """The AttachContainerRequest of a foreground container (hold.py's _attach): lease_id = 1,
    container_id = 2, warn_signal = 5, name = 6, image = 7."""
    return (_string(1, lease_id) + _string(2, container_id) + _varint(5 << 3) + _varint(WARN_SIGNAL)
            + _string(6, name) + _string(7, image))


class _Namer(threading.Thread):
    """hold.py's _Namer over the identity socket: names the container once its engine made it."""

    def __init__(self, run: ContainerRun, lease_id: str, cidfile: str, path: str, socket_arg: str | None) -> None:
        super().__init__(name=f"vaccel-container-{lease_id}", daemon=True)
        self.container_run, self.lease_id, self.cidfile = run, lease_id, cidfile
        self.path, self.socket_arg = path, socket_arg
        self._done = threading.Event()

    def run(self) -> None:
        container = container_argv.wait_for_id(self.cidfile, self._done, CREATE_WAIT_S)
        if not container:
            return
        refused = self._attach(container)
        if refused and not self._done.wait(SETTLE_S):
            print(f"vaccel: warning: lease {self.lease_id} does not follow container {container[:12]}: "
                  f"{refused}; the container is stopped only through {self.container_run.engine} if "
                  "vaccel run is killed", file=sys.stderr, flush=True)

    def _attach(self, container: str) -> str:
        """AttachContainer; "" when the lease follows the container (or it has exited already:
        nothing to follow), else the broker's refusal."""
        names = self.container_run.values("--name")
        request = attach_request(self.lease_id, container, names[-1] if names else "", self.container_run.image)
        try:
            answer = ask(identity_socket(self.path), "AttachContainer", request)
        except OSError:
            answer = None
        if answer is None or answer[0] == _UNIMPLEMENTED:  # an older broker: over gRPC, as the full path
            return self._attach_over_grpc(container)
        return "" if answer[0] in (0, _NOT_FOUND) else answer[1].decode(errors="replace")

    def _attach_over_grpc(self, container: str) -> str:
        from vaccel.containers.hold import _attach
        from vaccel.session.lease import LeaseError
        from vaccel.session.lease_session import LeaseSession

        with LeaseSession(self.socket_arg) as session:
            try:
                _attach(self.container_run, session, _Named(self.lease_id), container, WARN_SIGNAL, held=False,
                        stop=self._done)  # type: ignore[arg-type]
            except LeaseError as exc:
                return "" if exc.code == "not_found" else str(exc)
        return ""

    def stop(self) -> None:
        self._done.set()


class _Named:
    """What hold.py's _attach reads of a Lease: its id."""

    def __init__(self, lease_id: str) -> None:
        self.id = lease_id
