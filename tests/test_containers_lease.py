"""The lease follows its container (issue 34): against the private dockerd of
tests/container_engine.py and a root broker told to ask it (`[containers] docker`), on the
2-GPU simulated host of tests/test_containers_run.py.

- a foreground `vaccel run -- docker run` names its container to the broker: `vaccel status`
  shows `root (container NAME)`; SIGKILL of `vaccel run` stops the container and frees the device;
- `docker run -d` under `vaccel run` leaves a lease the container holds alone: no heartbeat,
  no client; it ends when the container stops, and `vaccel release` (or a revoke, warned
  first) stops the container;
- a client naming some other container, or a host process, as its own gets nothing applied,
  watched or stopped.
Other users, the join from inside and the queue between two users' containers:
tests/test_containers_users.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Broker
from tests.container_engine import IMAGE, PODMAN_IMAGE, DockerEngine
from tests.podman_engine import RootfulPodman
from tests.test_containers_run import UUIDS, docker_run, gpu_nodes  # noqa: F401 - gpu_nodes: fixture

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and a private dockerd need root")

STOP_GRACE_S = 2
# Python that says when it is warned (the lease's warning signal) and then sleeps on.
WARNED = ("import signal, time\n"
          "signal.signal(signal.SIGUSR1, lambda *_: print('warned', flush=True))\n"
          "print('started', flush=True)\n"
          "time.sleep(600)\n")


def config_for(engine: DockerEngine, ttl: str = "3s") -> str:
    return (f'[leases]\nheartbeat_ttl = "{ttl}"\n[probe]\nrefresh_interval = "1s"\n'
            f'[containers]\ndocker = "{engine.host}"\nstop_grace = "{STOP_GRACE_S}s"\n')


@pytest.fixture
def host(start_broker, gpu_nodes: list[str], docker_engine: DockerEngine,  # noqa: F811 - gpu_nodes: fixture
         tmp_path: Path) -> Iterator[Broker]:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("devices:\n" + "".join(
        f"  - {{vendor: nvidia, name: Sim GPU, uuid: {uuid}, memory_mib: 16384, compute_capability: '8.0', "
        f"device_nodes: [{node}]}}\n" for uuid, node in zip(UUIDS, gpu_nodes, strict=True)))
    before = set(lease_containers(docker_engine))
    yield start_broker(inventory, config_for(docker_engine))
    left = set(lease_containers(docker_engine)) - before
    if left:
        docker_engine.docker("rm", "-f", *left)


def lease_containers(engine: DockerEngine) -> list[str]:
    return engine.docker("ps", "-aq", "--filter", "label=org.vaccel.lease", check=True).stdout.split()


def running(engine: DockerEngine, name: str) -> bool:
    shown = engine.docker("inspect", "--format", "{{.State.Running}}", name)
    return shown.returncode == 0 and shown.stdout.strip() == "true"


def status(broker: Broker) -> dict:
    r = broker.vaccel("status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def holder_of(broker: Broker, lease_id: str) -> dict | None:
    return next((d["holder"] for d in status(broker)["devices"] if d["lease_id"] == lease_id), None)


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not met in {timeout}s")


def vaccel_popen(broker: Broker, engine: DockerEngine, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", *args], env={**broker.env,
                            "DOCKER_HOST": engine.host}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lease_id_in(stderr_line: str) -> str:
    found = re.search(r"vaccel: lease (l-[\w-]+)", stderr_line)
    assert found, stderr_line
    return found.group(1)


def test_sigkill_of_a_foreground_vaccel_run_stops_its_container_and_frees_the_device(host: Broker,
                                                                                     docker_engine: DockerEngine):
    run = vaccel_popen(host, docker_engine, "--device", "gpu0", "--",
                       *docker_run(docker_engine, "--name", "fg-sleeper", IMAGE, "sleep", "600"))
    try:
        lease_id = lease_id_in(run.stderr.readline())
        holder = wait_for(lambda: (h := holder_of(host, lease_id)) and h["container"] and h,
                          what="the container named to the broker")
        assert holder["container"]["name"] == "fg-sleeper" and holder["container"]["engine"] == "docker"
        assert holder["container"]["image"] == IMAGE and len(holder["container"]["id"]) == 64
        assert holder["pid"] == run.pid  # in the foreground vaccel run holds it, and the container ends it too
        text = host.vaccel("status").stdout
        assert "root (container fg-sleeper)" in text, text
        run.send_signal(signal.SIGKILL)  # the docker client dies with it; the container would not
        run.wait(10)
        wait_for(lambda: not running(docker_engine, "fg-sleeper"), 3 * STOP_GRACE_S + 10, "the container stopped")
        assert [d["state"] for d in status(host)["devices"]] == ["free", "free"]
        log = host.log.read_text()
        assert f"lease {lease_id}" in log and "stopped container fg-sleeper" in log
    finally:
        run.kill()
        run.wait(10)


def test_the_containers_exit_ends_its_lease_at_once(host: Broker, docker_engine: DockerEngine):
    run = vaccel_popen(host, docker_engine, "--device", "gpu0", "--",
                       *docker_run(docker_engine, "--name", "fg-exits", IMAGE, "sleep", "600"))
    try:
        lease_id = lease_id_in(run.stderr.readline())
        wait_for(lambda: (h := holder_of(host, lease_id)) and h["container"], what="the container named")
        docker_engine.docker("kill", "fg-exits", check=True)
        assert run.wait(30) == 128 + signal.SIGKILL  # the container's status, as the engine's client reports it
        ended = json.loads(host.vaccel("leases", "--ended", "--json").stdout)["leases"]
        assert [(lease["state"], lease["end_reason"]) for lease in ended if lease["id"] == lease_id] in (
            [("holder_exited", "container fg-exits exited")], [("released", "released by its holder")])
    finally:
        run.kill()
        run.wait(10)


def test_a_detached_container_holds_its_lease_until_it_stops(host: Broker, docker_engine: DockerEngine):
    r = host.vaccel("run", "--device", "gpu1", "--",
                    *docker_run(docker_engine, "-d", "--name", "detached", IMAGE, "sleep", "600"),
                    env={**host.env, "DOCKER_HOST": docker_engine.host}, timeout=120)
    assert r.returncode == 0, r.stderr
    lease_id = lease_id_in(r.stderr)
    container = r.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", container), r.stdout  # docker's own output, as without vaccel
    assert f"lease {lease_id} is held by container detached ({container[:12]})" in r.stderr
    init = int(docker_engine.inspect("detached", "{{.State.Pid}}"))
    holder = holder_of(host, lease_id)
    assert holder is not None and holder["pid"] == init and holder["container"]["id"] == container
    time.sleep(4)  # past the 3 s TTL: no client beats, the container holds it
    assert holder_of(host, lease_id) is not None
    docker_engine.docker("stop", "detached", check=True)
    wait_for(lambda: holder_of(host, lease_id) is None, 15, "the lease ended with its container")
    ended = json.loads(host.vaccel("leases", "--ended", "--json").stdout)["leases"]
    assert [(lease["state"], lease["end_reason"]) for lease in ended if lease["id"] == lease_id] == [
        ("holder_exited", "container detached exited")]


def test_a_release_with_grace_warns_the_detached_container_then_stops_it(host: Broker, docker_engine: DockerEngine):
    r = host.vaccel("run", "--device", "gpu0", "--",
                    *docker_run(docker_engine, "-d", "--name", "warned", IMAGE, sys.executable, "-c", WARNED),
                    env={**host.env, "DOCKER_HOST": docker_engine.host}, timeout=120)
    assert r.returncode == 0, r.stderr
    lease_id = lease_id_in(r.stderr)
    wait_for(lambda: "started" in docker_engine.docker("logs", "warned").stdout, what="the command started")
    r = host.vaccel("release", lease_id, "--grace", "5s", "--reason", "maintenance")
    assert r.returncode == 0, r.stderr
    wait_for(lambda: "warned" in docker_engine.docker("logs", "warned").stdout, 10, "the warning signal")
    assert holder_of(host, lease_id) is not None  # warned at the notice, while the grace runs
    wait_for(lambda: not running(docker_engine, "warned"), 5 + 3 * STOP_GRACE_S + 10, "the container stopped")
    assert [d["state"] for d in status(host)["devices"]] == ["free", "free"]
    log = host.log.read_text()
    assert log.index("container_warn") < log.index(f"lease {lease_id} of root ended") < log.index("stopped container")


def test_a_client_naming_another_container_or_a_host_process_gets_nothing(host: Broker,
                                                                          docker_engine: DockerEngine):
    """The client holds a lease and names, as the container it started for it, a container
    of no lease and then a host process of root: both refused; after the lease ends, neither
    was stopped nor signalled."""
    other = docker_engine.docker("run", "-d", *docker_engine.image_args(), IMAGE, "sleep", "600",
                                 check=True).stdout.strip()
    bystander = subprocess.Popen(["sleep", "600"])
    code = (
        "import grpc, sys\nfrom vaccel.session.connection import BrokerConnection\n"
        "from vaccel.session.lease_session import LeaseRequest, LeaseSession\n"
        "from vaccel_common.v1 import broker_pb2 as pb\n"
        "with LeaseSession(None) as session:\n"
        "    lease = session.acquire(LeaseRequest(wait=False))\n"
        "    session.start_heartbeat()\n"
        "    for cid, pid in ((sys.argv[1], 0), ('', int(sys.argv[2])), (sys.argv[1], int(sys.argv[2]))):\n"
        "        try:\n"
        "            session.connection.call('AttachContainer', pb.AttachContainerRequest(\n"
        "                lease_id=lease.id, container_id=cid, init_pid=pid, held=True))\n"
        "            print('ATTACHED')\n"
        "        except grpc.RpcError as e:\n"
        "            print(e.code().name, e.details())\n"
        "    session.release()\n")
    try:
        r = subprocess.run([sys.executable, "-c", code, other, str(bystander.pid)], env=host.env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert len(lines) == 3 and not any("ATTACHED" in line for line in lines), r.stdout
        assert all(line.startswith("FAILED_PRECONDITION") for line in lines), r.stdout
        assert "is not lease" in lines[0] and "is not lease" in lines[2]
        time.sleep(STOP_GRACE_S + 1)  # what a lease's end would stop is stopped by then
        assert running(docker_engine, other) and bystander.poll() is None
        assert [d["state"] for d in status(host)["devices"]] == ["free", "free"]
    finally:
        bystander.kill()
        bystander.wait()
        docker_engine.docker("rm", "-f", other)


def test_a_time_limit_warns_the_detached_container_then_stops_it(host: Broker, docker_engine: DockerEngine):
    r = host.vaccel("run", "--device", "gpu1", "--time", "5s", "--",
                    *docker_run(docker_engine, "-d", "--name", "timed", IMAGE, sys.executable, "-c", WARNED),
                    env={**host.env, "DOCKER_HOST": docker_engine.host}, timeout=120)
    assert r.returncode == 0, r.stderr
    lease_id = lease_id_in(r.stderr)
    wait_for(lambda: "warned" in docker_engine.docker("logs", "timed").stdout, 15, "the warning before the limit")
    wait_for(lambda: not running(docker_engine, "timed"), 5 + 3 * STOP_GRACE_S + 10, "the container stopped")
    ended = json.loads(host.vaccel("leases", "--ended", "--json").stdout)["leases"]
    assert [lease["state"] for lease in ended if lease["id"] == lease_id] == ["time_limit"]


def test_a_restart_keeps_a_container_held_lease_and_its_container(host: Broker, docker_engine: DockerEngine):
    env = {**host.env, "DOCKER_HOST": docker_engine.host}
    leases = {}
    for name, device in (("kept", "gpu0"), ("gone", "gpu1")):
        r = host.vaccel("run", "--device", device, "--",
                        *docker_run(docker_engine, "-d", "--name", name, IMAGE, "sleep", "600"), env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        leases[name] = lease_id_in(r.stderr)
    before = holder_of(host, leases["kept"])
    host.stop()
    docker_engine.docker("stop", "gone", check=True)  # while the broker is down
    host.start()
    assert holder_of(host, leases["kept"]) == before  # the same container, the same init: watched again
    ended = json.loads(host.vaccel("leases", "--ended", "--json").stdout)["leases"]
    assert [(lease["state"], lease["end_reason"]) for lease in ended if lease["id"] == leases["gone"]] == [
        ("holder_exited", "container gone exited while the broker was down")]
    docker_engine.docker("stop", "kept", check=True)
    wait_for(lambda: holder_of(host, leases["kept"]) is None, 15, "the lease ended with its container")


def test_rootful_podman_through_its_api_the_same_way(start_broker, gpu_nodes: list[str],  # noqa: F811 - fixture
                                                     rootful_podman: RootfulPodman, tmp_path: Path):
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("devices:\n" + "".join(
        f"  - {{vendor: nvidia, name: Sim GPU, uuid: {uuid}, memory_mib: 16384, compute_capability: '8.0', "
        f"device_nodes: [{node}]}}\n" for uuid, node in zip(UUIDS, gpu_nodes, strict=True)))
    broker = start_broker(inventory, f'[containers]\npodman = "{rootful_podman.host}"\nstop_grace = "1s"\n')
    podman = ["/usr/bin/podman", "run", "-d", "--name", "rootful-held", *rootful_podman.image_args(), PODMAN_IMAGE,
              "sleep", "600"]
    r = broker.vaccel("run", "--device", "gpu1", "--", *podman, env={**broker.env, **rootful_podman.env}, timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        lease_id = lease_id_in(r.stderr)
        holder = holder_of(broker, lease_id)
        assert holder is not None and holder["container"]["engine"] == "podman"
        assert holder["pid"] == int(rootful_podman.inspect("rootful-held", "{{.State.Pid}}"))
        assert broker.vaccel("release", lease_id).returncode == 0
        wait_for(lambda: rootful_podman.inspect("rootful-held", "{{.State.Running}}") == "false", 30,
                 "the container stopped")
    finally:
        rootful_podman.podman("rm", "-f", "rootful-held")


def test_a_short_container_is_followed_or_gone_without_a_warning(host: Broker, docker_engine: DockerEngine):
    """`true` can end before vaccel run names its container: nothing is left to follow, and
    nothing is said about it."""
    for _ in range(3):
        r = host.vaccel("run", "--", *docker_run(docker_engine, IMAGE, "true"),
                        env={**host.env, "DOCKER_HOST": docker_engine.host})
        assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
