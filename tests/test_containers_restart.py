"""Containers after their lease (issue 42): the broker follows its engine's events, against the
private dockerd of tests/container_engine.py, on the 2-GPU simulated host of
tests/test_containers_run.py.

- the next morning, `docker start` of a container whose lease ended while another lease holds
  its GPU is stopped (the journal and `vaccel status` say why), the other lease untouched;
- a `--restart always` container of an ended lease is not running after an engine restart;
- one that started while the broker was down is stopped when the broker starts;
- a container of an image committed from a leased container survives that lease's end.
Each waits for the event (the stop), never for a time; the start-to-stop times are printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, Broker
from tests.container_engine import IMAGE, PODMAN_IMAGE, DockerEngine
from tests.podman_engine import RootfulPodman
from tests.test_containers_lease import config_for, lease_id_in, running, status, wait_for
from tests.test_containers_run import UUIDS, gpu_nodes  # noqa: F401 - gpu_nodes: fixture

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and a private dockerd need root")


@pytest.fixture
def inventory(gpu_nodes: list[str], tmp_path: Path) -> Path:  # noqa: F811 - gpu_nodes: fixture
    path = tmp_path / "inventory.yaml"
    path.write_text("devices:\n" + "".join(
        f"  - {{vendor: nvidia, name: Sim GPU, uuid: {uuid}, memory_mib: 16384, compute_capability: '8.0', "
        f"device_nodes: [{node}]}}\n" for uuid, node in zip(UUIDS, gpu_nodes, strict=True)))
    return path


@pytest.fixture
def engine(docker_engine: DockerEngine) -> Iterator[DockerEngine]:
    before = set(docker_engine.docker("ps", "-aq", check=True).stdout.split())
    yield docker_engine
    left = set(docker_engine.docker("ps", "-aq").stdout.split()) - before
    if left:
        docker_engine.docker("rm", "-f", *left)


@pytest.fixture
def host(start_broker, inventory: Path, engine: DockerEngine) -> Broker:
    return start_broker(inventory, config_for(engine))


def keep_args(engine: DockerEngine) -> list[str]:
    """`docker run` of the test image, kept after it stops (no --rm): to be started again."""
    mounts = [w for path in (sys.prefix, str(ROOT)) for w in ("-v", f"{path}:{path}:ro")]
    return ["/usr/bin/docker", "run", *engine.image_args(), *mounts]


def detached(broker: Broker, engine: DockerEngine, device: str, *args: str) -> str:
    """`vaccel run --device DEVICE -- docker run -d ...`: the lease the container holds."""
    r = broker.vaccel("run", "--device", device, "--", *keep_args(engine), "-d", *args,
                      env={**broker.env, "DOCKER_HOST": engine.host}, timeout=120)
    assert r.returncode == 0, r.stderr
    return lease_id_in(r.stderr)


def ended(broker: Broker, lease_id: str) -> bool:
    r = broker.vaccel("leases", "--ended", "--json")
    return r.returncode == 0 and any(lease["id"] == lease_id for lease in json.loads(r.stdout)["leases"])


def lease_on(broker: Broker, device: str) -> dict | None:
    return next((d for d in status(broker)["devices"] if d["label"] == device and d["lease_id"]), None)


def stopped_for(broker: Broker, name: str) -> dict | None:
    return next((c for c in status(broker)["stopped_containers"] if c["name"] == name), None)


def hold(broker: Broker, device: str) -> subprocess.Popen[str]:
    """Another lease on `device`, held by a plain `vaccel run -- sleep`."""
    run = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--device", device, "--", "sleep", "600"],
                           env=broker.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lease_id_in(run.stderr.readline())
    return run


def test_the_next_morning_start_of_an_ended_leases_container_is_stopped(host: Broker, engine: DockerEngine):
    old = detached(host, engine, "gpu0", "--name", "zhang-nb", IMAGE, "sleep", "600")
    engine.docker("stop", "zhang-nb", check=True)  # the end of the day: the lease ends with it
    wait_for(lambda: ended(host, old), what="the lease ended with its container")
    other = hold(host, "gpu0")  # the next student, on the same GPU
    try:
        theirs = wait_for(lambda: lease_on(host, "gpu0"), what="the other lease")
        started = time.monotonic()
        engine.docker("start", "zhang-nb", check=True)
        wait_for(lambda: not running(engine, "zhang-nb"), 60, "the old container stopped")
        print(f"\ndocker start -> stopped: {time.monotonic() - started:.3f}s (docker start's own time included)")
        stop = wait_for(lambda: stopped_for(host, "zhang-nb"), what="status says so")
        assert stop["lease_id"] == old and "has ended" in stop["reason"], stop
        text = host.vaccel("status").stdout
        assert "zhang-nb (docker" in text and "docker start -a zhang-nb" in text, text
        log = host.log.read_text()
        assert "docker container zhang-nb started and it carries the label of lease " + old in log, log
        assert lease_on(host, "gpu0")["lease_id"] == theirs["lease_id"] and other.poll() is None  # untouched
    finally:
        other.kill()
        other.wait(10)


def test_a_restart_policy_container_of_an_ended_lease_stays_down_after_an_engine_restart(
        host: Broker, engine: DockerEngine):
    old = detached(host, engine, "gpu1", "--restart", "always", "--name", "always-nb", IMAGE, "sleep", "600")
    engine.proc.send_signal(signal.SIGTERM)  # the engine's shutdown stops the container: the lease ends
    engine.proc.wait(60)
    wait_for(lambda: ended(host, old), what="the lease ended as the engine stopped its container")
    engine.start()  # the engine brings `--restart always` back before its API answers
    wait_for(lambda: stopped_for(host, "always-nb"), 60, "the broker stopped it again")
    assert not running(engine, "always-nb")
    assert engine.inspect("always-nb", "{{.HostConfig.RestartPolicy.Name}}") == "always"
    assert "running when the broker began to follow its engine" in host.log.read_text()


def test_a_container_started_while_the_broker_was_down_is_stopped_at_its_start(
        start_broker, inventory: Path, engine: DockerEngine):
    broker = start_broker(inventory, config_for(engine))
    old = detached(broker, engine, "gpu0", "--name", "while-down", IMAGE, "sleep", "600")
    engine.docker("stop", "while-down", check=True)
    wait_for(lambda: ended(broker, old), what="the lease ended with its container")
    broker.stop()
    engine.docker("start", "while-down", check=True)
    broker.start()
    wait_for(lambda: stopped_for(broker, "while-down"), 60, "stopped at the broker's start")
    assert not running(engine, "while-down")


def test_a_container_of_a_committed_image_survives_the_original_leases_end(host: Broker, engine: DockerEngine):
    lease_id = detached(host, engine, "gpu0", "--name", "to-commit", IMAGE, "sleep", "600")
    engine.docker("commit", "to-commit", "vaccel-committed:1", check=True)
    try:
        # A plain container of it: the lease's labels come with the image, no device does.
        engine.docker("run", "-d", *engine.image_args(), "--name", "from-commit", "vaccel-committed:1",
                      "sleep", "600", check=True)
        assert engine.inspect("from-commit", '{{index .Config.Labels "org.vaccel.lease"}}') == lease_id
        assert host.vaccel("release", lease_id).returncode == 0
        wait_for(lambda: f"lease {lease_id} ended" in host.log.read_text()
                 and "stopped container to-commit" in host.log.read_text(), 60, "the leased container stopped")
        assert not running(engine, "to-commit") and running(engine, "from-commit")
        engine.docker("restart", "from-commit", check=True)  # and it may start again
        assert running(engine, "from-commit") and stopped_for(host, "from-commit") is None
    finally:
        engine.docker("rm", "-f", "from-commit")
        engine.docker("rmi", "vaccel-committed:1")


def test_a_plain_container_given_a_leased_devices_node_is_stopped(host: Broker, engine: DockerEngine,
                                                                   gpu_nodes: list[str]):  # noqa: F811 - fixture
    other = hold(host, "gpu1")
    try:
        theirs = wait_for(lambda: lease_on(host, "gpu1"), what="the other lease")
        # No vaccel, no label: the node under another name (a symlink) is the same device.
        link = Path(gpu_nodes[1]).with_name("another-name")
        link.symlink_to(gpu_nodes[1])
        try:
            engine.docker("run", "-d", *engine.image_args(), "--device", f"{link}:/dev/x", "--name", "sneaky",
                          IMAGE, "sleep", "600", check=True)
            stop = wait_for(lambda: stopped_for(host, "sneaky"), 60, "the broker stopped it")
        finally:
            link.unlink()
        assert not running(engine, "sneaky")
        assert stop["lease_id"] == "" and f"leased to root (lease {theirs['lease_id']})" in stop["reason"], stop
        # A plain container given no device runs on.
        engine.docker("run", "-d", *engine.image_args(), "--name", "harmless", IMAGE, "sleep", "600", check=True)
        assert running(engine, "harmless")
        assert lease_on(host, "gpu1")["lease_id"] == theirs["lease_id"] and other.poll() is None
    finally:
        other.kill()
        other.wait(10)


def test_rootful_podman_the_next_morning_the_same_way(start_broker, inventory: Path,
                                                      rootful_podman: RootfulPodman):
    broker = start_broker(inventory, f'[containers]\npodman = "{rootful_podman.host}"\nstop_grace = "1s"\n')
    podman = ["/usr/bin/podman", "run", "-d", "--name", "podman-nb", *rootful_podman.image_args(), PODMAN_IMAGE,
              "sleep", "600"]
    r = broker.vaccel("run", "--device", "gpu0", "--", *podman, env={**broker.env, **rootful_podman.env},
                      timeout=120)
    assert r.returncode == 0, r.stderr
    old = lease_id_in(r.stderr)
    try:
        rootful_podman.podman("stop", "podman-nb", check=True)
        wait_for(lambda: ended(broker, old), what="the lease ended with its container")
        rootful_podman.podman("start", "podman-nb", check=True)
        stop = wait_for(lambda: stopped_for(broker, "podman-nb"), 60, "the broker stopped it")
        assert stop["engine"] == "podman" and stop["lease_id"] == old
        wait_for(lambda: rootful_podman.inspect("podman-nb", "{{.State.Running}}") == "false", 30, "stopped")
    finally:
        rootful_podman.podman("rm", "-f", "podman-nb")
