"""`vaccel run [lease options] -- docker start [-a] NAME` (also `docker container start`,
`docker restart`, and podman's): the way back to a container made under an earlier lease.

Such a container has its old lease's devices, variables and labels baked in, and the broker
stops it when it starts outside a live lease (docs/containers.md). Here:
1. the container is read (`docker inspect`): the devices it was made with (the label
   `org.vaccel.devices` vaccel puts on it; for containers made before that label, the UUIDs
   in its VACCEL_DEVICES), and that it was made under vaccel run;
2. exactly those devices are leased, waiting in the fair queue like any request (`--time`,
   `--wait` and the other lease options apply; `--gpus`/`--device` are refused: the devices
   were fixed when the container was made);
3. the broker is told the container starts under the new lease (AttachContainer with
   `starting`: it checks that the container is the caller's and made with those devices),
   the engine starts it, and the lease follows it: with `-a` in the foreground (its exit
   ends the lease, vaccel run killed stops it), else it holds the lease alone, as `-d`.
Inside the container VACCEL_LEASE_ID still names the old lease (an engine cannot change a
made container's variables): the devices are the same, joining from inside is not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, NamedTuple

from vaccel.containers import engine_command as containers
from vaccel.containers.argv import DEVICES_LABEL, USER_LABEL
from vaccel.containers.engine_command import ContainerRefused, ContainerRun, Option
from vaccel.containers.hold import INIT_WAIT_S, Supervise, _attach, run_container  # the same call as after a `run`
from vaccel.session.grpc_lazy import grpc
from vaccel.session.lease import Lease, LeaseError
from vaccel_common.v1 import broker_pb2 as pb

if TYPE_CHECKING:
    from vaccel.session.lease_session import LeaseSession

_S = containers._Syntax  # the engines' option syntax, read the same way as `run`'s
_START = _S(frozenset({"--detach-keys", "--checkpoint", "--checkpoint-dir"}),
            frozenset({"--attach", "--interactive", "--sig-proxy"}), {"a": "--attach", "i": "--interactive"})
_RESTART = _S(frozenset({"--time", "--signal"}), frozenset(), {"t": "--time", "s": "--signal"})
COMPOSE_PROGRAMS = frozenset({"docker-compose", "podman-compose"})
_SUBCOMMANDS = {("start",): _START, ("container", "start"): _START, ("restart",): _RESTART,
                ("container", "restart"): _RESTART}


class ContainerStart(NamedTuple):
    """An engine's `start`/`restart` of one container, read, and the container as inspected."""

    engine: str
    program: str
    global_words: tuple[str, ...]
    subcommand: tuple[str, ...]
    option_words: tuple[str, ...]
    name: str  # as the user named it
    attach: bool  # `start -a`: in the foreground
    container_id: str = ""
    image: str = ""
    devices: tuple[str, ...] = ()  # the UUIDs it was made with
    options: tuple[Option, ...] = ()
    starts = True  # what vaccel/containers/hold.py dispatches on

    def values(self, name: str) -> list[str]:
        return [self.name] if name == "--name" else []

    def argv(self) -> list[str]:
        return [self.program, *self.global_words, *self.subcommand, *self.option_words, self.name]


def recognise_start(argv: list[str]) -> ContainerStart | None:
    """The command read as an engine's start or restart of one container, inspected; None for
    any other command. ContainerRefused, saying what to do, for one vaccel cannot lease for
    (compose among them)."""
    program = os.path.basename(argv[0]) if argv else ""
    engine = containers.ENGINE_PROGRAMS.get(program)
    if program in COMPOSE_PROGRAMS:
        _refuse_compose(program)
    if engine is None:
        return None
    _, at, _ = containers._read_options(argv, 1, engine.global_options, engine.name)
    if argv[at:at + 1] == ["compose"]:
        _refuse_compose(f"{engine.name} compose")
    sub = next((s for s in _SUBCOMMANDS if tuple(argv[at:at + len(s)]) == s), None)
    if sub is None:
        return None
    what = f"{engine.name} {' '.join(sub)}"
    options, name_at, _ = containers._read_options(argv, at + len(sub), _SUBCOMMANDS[sub], what)
    names = argv[name_at:]
    if len(names) != 1:
        raise ContainerRefused(f"{what} under vaccel run starts one container: vaccel run [lease options] -- "
                               f"{what} [-a] NAME")
    attach = sub[-1] == "start" and any(o.name == "--attach" and o.on for o in options)
    start = ContainerStart(engine.name, argv[0], tuple(argv[1:at]), sub, tuple(argv[at + len(sub):name_at]),
                           names[0], attach, options=tuple(options))
    return _inspected(start)


def lease_options(container: ContainerRun | ContainerStart, args: argparse.Namespace, gpus: int,
                  devices: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
    """(gpus, devices) to lease for a container command, refused (CliError, exit status 2)
    before anything is asked for where the lease options do not fit it: `run -d` inside a
    reservation, device options for `docker start` (the devices it was made with are leased)."""
    from vaccel.session.outcome import EXIT_USAGE, CliError

    if not isinstance(container, ContainerStart):
        if args.lease and container.detached:
            raise CliError(f"{container.engine} run -d with --lease: a detached container would hold your "
                           "reservation alone; run it in the foreground, or without --lease", EXIT_USAGE)
        return gpus, devices
    if args.lease or devices or args.gpus is not None or getattr(args, "memory", None):
        raise CliError(f"{container.engine} {container.subcommand[-1]} under vaccel run leases the devices the "
                       "container was made with: give lease options (--time, --wait) only, not --gpus, --device, "
                       "--memory or --lease", EXIT_USAGE)
    return len(container.devices), container.devices


def _refuse_compose(what: str) -> None:
    # Compose starts its services itself: none would get the lease, and each whatever devices the
    # compose file names. Refused, not run ungoverned.
    raise ContainerRefused(f"vaccel run does not govern {what}: its services would run without the lease, on "
                           "whatever GPUs the compose file names; run each GPU service as `vaccel run [lease "
                           f"options] -- docker run ...`, and the services without GPUs with {what} itself")


def _inspected(start: ContainerStart) -> ContainerStart:
    done = subprocess.run([start.program, *start.global_words, "inspect", "--type", "container", "--format",
                           "{{json .}}", start.name], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise ContainerRefused(f"{start.engine} knows no container {start.name}: "
                               f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'inspect failed'}")
    try:
        doc = json.loads(done.stdout)
        doc = doc[0] if isinstance(doc, list) else doc  # podman 4 writes a list of one
        config = doc.get("Config") or {}
    except (ValueError, IndexError, AttributeError):
        raise ContainerRefused(f"{start.engine} inspect {start.name}: not the container's description") from None
    labels = config.get("Labels") or {}
    env = dict(item.partition("=")[::2] for item in config.get("Env") or ())
    if USER_LABEL not in labels:
        raise ContainerRefused(f"container {start.name} was not made under vaccel run: vaccel cannot tell which "
                               f"devices it was given; make it under a lease: vaccel run ... -- {start.engine} run ...")
    devices = _devices(labels, env)
    if not devices:
        raise ContainerRefused(f"container {start.name} names no device it was made with; make a new one: "
                               f"vaccel run ... -- {start.engine} run ...")
    if start.subcommand[-1] == "start" and (doc.get("State") or {}).get("Running"):
        raise ContainerRefused(f"container {start.name} runs already: `{start.engine} stop {start.name}` first, "
                               f"or `vaccel run -- {start.engine} restart {start.name}`")
    return ContainerStart(start.engine, start.program, start.global_words, start.subcommand, start.option_words,
                          start.name, start.attach, str(doc.get("Id", "")), str(config.get("Image", "")), devices,
                          start.options)


def _devices(labels: dict[str, str], env: dict[str, str]) -> tuple[str, ...]:
    """The UUIDs the container was made with: vaccel's label; for a container made before it,
    the UUIDs in its variables (an ordinal there is renumbered, so it names nothing)."""
    for text in (labels.get(DEVICES_LABEL, ""), env.get("VACCEL_DEVICES", "")):
        ids = tuple(i for i in text.split(",") if i)
        if ids and not any(i.isdigit() or i in ("all", "void", "none") for i in ids):
            return ids
    return ()


def run_or_start(run: ContainerRun | ContainerStart, session: LeaseSession, lease: Lease, socket: str,
                 warn_signal: int | None, supervise: Supervise) -> int:
    """The container run (container_hold.py) or started again (here) under the lease."""
    if isinstance(run, ContainerStart):
        return start_container(run, session, lease, warn_signal, supervise)
    return run_container(run, session, lease, socket, warn_signal, supervise)


def start_container(start: ContainerStart, session: LeaseSession, lease: Lease, warn_signal: int | None,
                    supervise: Supervise) -> int:
    """Start the container under the lease and make the lease follow it; the engine's status."""
    if lease.joined:
        raise ContainerRefused(f"{start.engine} {start.subcommand[-1]} with --lease: the container would hold your "
                               "reservation; run it without --lease")
    rootless = start.engine == "podman" and os.geteuid() != 0  # no engine the broker asks: the kernel confirms
    if not rootless:
        _let_start(session, lease, start)
    if not start.attach:
        code = supervise(start.argv())
        if code != 0:
            return code
        _attach(start, session, lease, start.container_id, warn_signal, held=True, wait_s=INIT_WAIT_S)  # type: ignore[arg-type]
        session.hand_over()
        print(f"vaccel: lease {lease.id} is held by container {start.name} ({start.container_id[:12]}) until it "
              f"stops, its time limit, or `vaccel release {lease.id}`", file=sys.stderr, flush=True)
        return 0
    done = threading.Event()
    namer = threading.Thread(target=_name_when_running, args=(start, session, lease, warn_signal, done), daemon=True)
    namer.start()
    try:
        return supervise(start.argv())
    finally:
        done.set()


def _let_start(session: LeaseSession, lease: Lease, start: ContainerStart) -> None:
    request = pb.AttachContainerRequest(lease_id=lease.id, container_id=start.container_id, starting=True,
                                        name=start.name, image=start.image)
    try:
        session.connection.call("AttachContainer", request, timeout=60, retry_unavailable_s=5)
    except grpc.RpcError as exc:
        raise LeaseError(f"container {start.name} may not start under lease {lease.id}: {exc.details()}",
                         exc.code().name.lower()) from None


def _name_when_running(start: ContainerStart, session: LeaseSession, lease: Lease, warn_signal: int | None,
                       done: threading.Event) -> None:
    wait = 0.01
    while not done.wait(wait):
        shown = subprocess.run([start.program, *start.global_words, "inspect", "--format", "{{.State.Running}}",
                                start.container_id], capture_output=True, text=True, timeout=30, check=False)
        if shown.stdout.strip() == "true":
            try:
                _attach(start, session, lease, start.container_id, warn_signal, held=False, stop=done)  # type: ignore[arg-type]
            except LeaseError as exc:
                if exc.code != "not_found" and not done.is_set():
                    print(f"vaccel: warning: {exc}", file=sys.stderr, flush=True)
            return
        wait = min(0.2, wait * 1.5)
