"""The broker's side of containers (brokerd/addons/containers/): which container a host process is
in, what its engine says of it, stopping it. On a fake /proc for the cgroup shapes no engine
here makes, then against the real engines of tests/container_engine.py: a private dockerd
(real containers, their real init pids and labels) and rootless podman as a real user.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokerd.addons.containers import locate
from brokerd.addons.containers.engine import EngineClient, EngineError
from brokerd.addons.containers.membership import Containers, RootlessContainer
from brokerd.config.loader import ConfigError, load_config
from tests.container_engine import IMAGE, PODMAN_IMAGE, DockerEngine
from tests.podman_engine import RootfulPodman, RootlessPodman

ID_A = "a" * 64
ID_B = "b" * 64


def fake_proc(tmp_path: Path, cgroup: str, pid: int = 42) -> Path:
    (tmp_path / str(pid)).mkdir(parents=True)
    (tmp_path / str(pid) / "cgroup").write_text(cgroup)
    return tmp_path


@pytest.mark.parametrize("cgroup, found", [
    (f"12:devices:/docker/{ID_A}\n0::/docker/{ID_A}\n", locate.ContainerRef("docker", ID_A)),
    (f"0::/system.slice/docker-{ID_A}.scope\n", locate.ContainerRef("docker", ID_A)),
    (f"5:memory:/libpod_parent/libpod-{ID_A}\n", locate.ContainerRef("podman", ID_A)),
    (f"0::/machine.slice/libpod-{ID_A}.scope/container\n", locate.ContainerRef("podman", ID_A)),
    (f"4:pids:/custom-parent/{ID_A}\n1:name=systemd:/docker/{ID_A}\n", locate.ContainerRef("docker", ID_A)),
    (f"4:pids:/custom-parent/{ID_A}\n", locate.ContainerRef("", ID_A)),
    ("12:devices:/\n0::/\n", None),  # a host process; a rootless container on cgroup v1
    (f"0::/machine.slice/libpod-conmon-{ID_A}.scope\n", None),  # podman's monitor, not the container
    (f"12:devices:/docker/{ID_A}\n11:memory:/docker/{ID_B}\n", None),  # hierarchies that disagree
    ("0::/user.slice/session-3.scope\n", None),
])
def test_the_cgroup_names_the_container(tmp_path: Path, cgroup: str, found):
    assert locate.container_of(42, fake_proc(tmp_path, cgroup)) == found


def test_a_process_that_is_gone_is_in_no_container(tmp_path: Path):
    assert locate.container_of(4242, tmp_path) is None
    assert locate.namespace_init(4242, tmp_path) is None


def test_a_host_process_has_no_container_and_no_namespace_init():
    assert locate.container_of(os.getpid()) is None
    assert locate.namespace_init(os.getpid()) is None


# -- against a real dockerd ---------------------------------------------------------------


def run(coro):
    return asyncio.run(coro)


def docker_client(engine: DockerEngine, timeout_s: float = 5.0) -> EngineClient:
    return EngineClient("docker", engine.host, timeout_s)


async def _with(client: EngineClient, call):
    try:
        return await call(client)
    finally:
        await client.close()


def containers(engine: DockerEngine) -> Containers:
    return Containers([docker_client(engine)])


def ask(engine: DockerEngine, method: str, *args):
    """One call of Containers on a fresh event loop (as the daemon's loop would make it)."""
    async def call():
        held = containers(engine)
        try:
            return await getattr(held, method)(*args)
        finally:
            await held.close()
    return run(call())


def start(engine: DockerEngine, name: str, *options: str, command: tuple[str, ...] = ("sleep", "300")) -> str:
    """A detached container of the test image; its full id."""
    return engine.docker("run", "-d", "--name", name, *engine.image_args(), *options, IMAGE, *command,
                         check=True).stdout.strip()


def host_pid_of(init: int, argv: list[str], timeout: float = 10.0) -> int:
    """The host pid of the process with command line `argv` in `init`'s pid namespace."""
    wanted = "\0".join(argv).encode() + b"\0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in (e for e in os.listdir("/proc") if e.isdigit()):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read() == wanted and locate.same_pid_namespace(int(entry), init):
                        return int(entry)
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no {argv} in the namespace of {init}")


@pytest.fixture
def leased(docker_engine: DockerEngine) -> Iterator[tuple[str, int]]:
    """A running container labelled as lease l-a of root's: (id, its init's host pid)."""
    cid = start(docker_engine, "lease-a", "--label", "org.vaccel.lease=l-a", "--label", "org.vaccel.user=root")
    yield cid, int(docker_engine.inspect(cid, "{{.State.Pid}}"))
    docker_engine.docker("rm", "-f", cid)


@pytest.fixture
def other(docker_engine: DockerEngine) -> Iterator[tuple[str, int]]:
    """Another running container, of lease l-b."""
    cid = start(docker_engine, "lease-b", "--label", "org.vaccel.lease=l-b", "--label", "org.vaccel.user=root")
    yield cid, int(docker_engine.inspect(cid, "{{.State.Pid}}"))
    docker_engine.docker("rm", "-f", cid)


def test_inspect_describes_the_container_as_the_engine_knows_it(docker_engine: DockerEngine, leased):
    cid, init = leased
    info = run(_with(docker_client(docker_engine), lambda c: c.inspect("lease-a")))
    assert (info.engine, info.id, info.name, info.image, info.pid, info.running) == (
        "docker", cid, "lease-a", IMAGE, init, True)
    assert info.labels["org.vaccel.lease"] == "l-a" and info.labels["org.vaccel.user"] == "root"
    assert run(_with(docker_client(docker_engine), lambda c: c.inspect("no-such-container"))) is None


def test_the_init_pid_of_a_real_container_is_located_by_its_cgroup(docker_engine: DockerEngine, leased):
    cid, init = leased
    assert locate.container_of(init) == locate.ContainerRef("docker", cid)
    assert locate.namespace_init(init) == init


def test_a_process_of_the_leases_container_belongs_to_the_lease(docker_engine: DockerEngine, leased):
    cid, init = leased
    assert ask(docker_engine, "lease_container_of", init, "l-a").id == cid
    # a process started later inside (`docker exec`, as a join from a notebook's terminal would be)
    docker_engine.docker("exec", "-d", cid, "sleep", "301", check=True)
    joined = host_pid_of(init, ["sleep", "301"])
    assert os.stat(f"/proc/{joined}").st_uid == 0  # container root is the host's uid 0
    assert ask(docker_engine, "lease_container_of", joined, "l-a").id == cid


def test_processes_of_other_containers_and_of_the_host_belong_to_no_lease(docker_engine: DockerEngine, leased,
                                                                          other):
    _, init = leased
    other_id, other_init = other
    unlabelled = start(docker_engine, "plain")
    try:
        plain_init = int(docker_engine.inspect(unlabelled, "{{.State.Pid}}"))
        assert ask(docker_engine, "lease_container_of", other_init, "l-a") is None
        assert ask(docker_engine, "lease_container_of", plain_init, "l-a") is None
        assert ask(docker_engine, "container_of", other_init).id == other_id
        dockerd = docker_engine.proc.pid
        for host_root_process in (os.getpid(), dockerd):
            assert ask(docker_engine, "lease_container_of", host_root_process, "l-a") is None
        assert ask(docker_engine, "lease_container_of", init, "l-b") is None
    finally:
        docker_engine.docker("rm", "-f", unlabelled)


def test_a_named_container_counts_only_when_the_engine_says_it_is_the_leases(docker_engine: DockerEngine, leased,
                                                                             other):
    cid, init = leased
    other_id, _ = other
    info = ask(docker_engine, "named_container", cid, "l-a", "root")
    assert (info.id, info.pid) == (cid, init)
    assert ask(docker_engine, "named_container", other_id, "l-a", "root") is None
    assert ask(docker_engine, "named_container", cid, "l-a", "alice") is None  # the user label must match too
    for not_an_id in ("lease-a", cid[:12], str(init), "1", "../../info", ""):
        assert ask(docker_engine, "named_container", not_an_id, "l-a", "root") is None


def test_stop_ends_the_container_with_sigterm_then_sigkill_after_the_grace(docker_engine: DockerEngine):
    # --init: sleep gets the SIGTERM and dies of it; sh as PID 1 ignores it and is killed after the grace.
    polite = start(docker_engine, "polite", "--init")
    stubborn = start(docker_engine, "stubborn", command=("sh", "-c", "sleep 300"))
    try:
        client = docker_client(docker_engine)
        assert run(_with(client, lambda c: c.stop(polite, 10))) is True
        assert run(_with(docker_client(docker_engine), lambda c: c.stop(stubborn, 1))) is True
        assert docker_engine.inspect(polite, "{{.State.Running}} {{.State.ExitCode}}") == "false 143"
        assert docker_engine.inspect(stubborn, "{{.State.Running}} {{.State.ExitCode}}") == "false 137"
        assert run(_with(docker_client(docker_engine), lambda c: c.stop(polite, 1))) is False  # already stopped
        assert run(_with(docker_client(docker_engine), lambda c: c.stop("no-such-container", 1))) is False
    finally:
        docker_engine.docker("rm", "-f", polite, stubborn)


def test_containers_stop_goes_through_the_engine_that_described_it(docker_engine: DockerEngine, leased):
    cid, init = leased

    async def find_and_stop():
        held = containers(docker_engine)
        try:
            info = await held.lease_container_of(init, "l-a")
            return await held.stop(info, 1)
        finally:
            await held.close()

    assert run(find_and_stop()) is True
    assert docker_engine.inspect(cid, "{{.State.Running}}") == "false"


def test_kill_signals_the_init(docker_engine: DockerEngine):
    cid = start(docker_engine, "killed", "--init")
    try:
        assert run(_with(docker_client(docker_engine), lambda c: c.kill(cid, "SIGKILL"))) is True
        docker_engine.docker("wait", cid, check=True)
        assert docker_engine.inspect(cid, "{{.State.ExitCode}}") == "137"
    finally:
        docker_engine.docker("rm", "-f", cid)


@pytest.fixture
def silent_socket(tmp_path: Path) -> Iterator[str]:
    """A Unix socket that accepts and never answers: an engine that hangs."""
    path = str(tmp_path / "hung.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield path
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_an_engine_that_hangs_or_is_absent_is_an_error_not_a_wait(silent_socket: str, tmp_path: Path):
    with pytest.raises(EngineError, match=r"no answer to GET /containers/x/json within 0\.3s"):
        run(_with(EngineClient("docker", silent_socket, timeout_s=0.3), lambda c: c.inspect("x")))
    with pytest.raises(EngineError, match="POST /containers/x/stop"):
        run(_with(EngineClient("docker", str(tmp_path / "absent.sock")), lambda c: c.stop("x", 1)))
    # asked through Containers, an engine that cannot answer confirms nothing
    held = Containers([EngineClient("docker", silent_socket, timeout_s=0.3)])
    assert run(_with_containers(held, lambda h: h.named_container("c" * 64, "l-a", "root"))) is None


async def _with_containers(held: Containers, call):
    try:
        return await call(held)
    finally:
        await held.close()


def test_the_containers_config_keys_are_read_and_checked(tmp_path: Path):
    path = tmp_path / "brokerd.toml"
    path.write_text('[containers]\ndocker = "unix:///run/docker.sock"\npodman = "/run/podman/podman.sock"\n'
                    'stop_grace = "30s"\n')
    config = load_config(path)
    assert (config.containers_docker, config.containers_podman, config.containers_stop_grace_s) == (
        "/run/docker.sock", "/run/podman/podman.sock", 30.0)
    assert (load_config(None).containers_docker, load_config(None).containers_stop_grace_s) == ("", 10.0)
    for bad, says in (('docker = "tcp://h:2375"', "over its local Unix socket"), ("podman = 1", "as a string"),
                      ('stop_grace = "2h"', "from 0s to 1h"), ('stop_grace = "soon"', "containers.stop_grace")):
        path.write_text(f"[containers]\n{bad}\n")
        with pytest.raises(ConfigError, match=says):
            load_config(path)


def test_containers_are_configured_only_for_the_engines_named():
    assert Containers.configured("", "") is None
    held = Containers.configured("unix:///run/docker.sock", "")
    assert [(e.engine, e.socket) for e in held.engines] == [("docker", "/run/docker.sock")]


# -- rootless podman: the kernel's word ------------------------------------------------------


def test_a_rootless_container_is_found_by_its_users_uid_and_pid_namespace(rootless_podman: RootlessPodman):
    cid = rootless_podman.podman("run", "-d", *rootless_podman.image_args(), PODMAN_IMAGE, "sh", "-c",
                                 "sleep 302 & wait", check=True).stdout.strip()
    try:
        init = int(rootless_podman.inspect(cid, "{{.State.Pid}}"))
        child = host_pid_of(init, ["sleep", "302"])
        uid = rootless_podman.user.pw_uid
        assert locate.container_of(child) is None  # cgroup v1: rootless podman makes no cgroup
        assert os.stat(f"/proc/{child}").st_uid == uid  # container root is the user on the host
        for pid, owner in ((child, 0), (os.getpid(), uid), (os.getpid(), 0)):
            assert RootlessContainer.of(pid, owner) is None
        found = RootlessContainer.of(child, uid)
        assert (found.pid, found.uid) == (init, uid)
        try:
            assert run(found.stop(1.0)) is True  # sh as PID 1 ignores SIGTERM: killed after the grace
        finally:
            found.close()
        rootless_podman.podman("wait", cid, check=True)
        assert rootless_podman.inspect(cid, "{{.State.Running}}") == "false"
    finally:
        rootless_podman.podman("rm", "-f", "-t", "0", cid)


# -- rootful podman: its Docker-compatible API -------------------------------------------------


def test_rootful_podmans_compatible_api_gives_the_same_answers(rootful_podman: RootfulPodman):
    cid = rootful_podman.podman("run", "-d", *rootful_podman.image_args(), "--label", "org.vaccel.lease=l-p",
                                "--label", "org.vaccel.user=root", PODMAN_IMAGE, "sleep", "303",
                                check=True).stdout.strip()
    init = int(rootful_podman.inspect(cid, "{{.State.Pid}}"))
    assert locate.container_of(init) == locate.ContainerRef("podman", cid)  # /libpod_parent/libpod-<id>

    async def decide():
        held = Containers([EngineClient("docker", "/nonexistent.sock"), EngineClient("podman", rootful_podman.host)])
        try:
            info = await held.lease_container_of(init, "l-p")
            named = await held.named_container(cid, "l-p", "root")
            other_lease = await held.lease_container_of(init, "l-x")
            stopped = await held.stop(info, 1)  # sleep as PID 1 ignores SIGTERM: SIGKILL after the grace
            return info, named, other_lease, stopped
        finally:
            await held.close()

    try:
        info, named, other_lease, stopped = run(decide())
        assert (info.engine, info.id, info.image, info.pid, info.running) == ("podman", cid, PODMAN_IMAGE, init, True)
        assert named.pid == init and other_lease is None and stopped is True
        assert rootful_podman.inspect(cid, "{{.State.Running}} {{.State.ExitCode}}") == "false 137"
    finally:
        rootful_podman.podman("rm", "-f", "-t", "0", cid)
