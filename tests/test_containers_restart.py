"""Containers after their lease (issue 42): the broker follows its engine's events, against the
private dockerd of tests/container_engine.py, on the 2-GPU simulated host of
tests/test_containers_run.py.

- the next morning, `docker start` of a container whose lease ended while another lease holds
  its GPU is stopped (the journal and `vaccel status` say why), the other lease untouched;
- a `--restart always` container of an ended lease is not running after an engine restart;
- one that started while the broker was down is stopped when the broker starts;
- a container of an image committed from a leased container survives that lease's end;
- `vaccel run [lease options] -- docker start [-a] NAME` leases exactly the devices the container
  was made with, waits for them in the queue, and the lease then follows the container.
Each waits for the event (the stop), never for a time; the start-to-stop times are printed.
"""

from __future__ import annotations

import json
import os
import pty
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
from tests.test_containers_lease import config_for, holder_of, lease_id_in, running, status, wait_for
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


# -- the way back: vaccel run -- docker start [-a] NAME --------------------------------------


def made_and_ended(broker: Broker, engine: DockerEngine, name: str, device: str) -> str:
    old = detached(broker, engine, device, "--name", name, IMAGE, "sleep", "600")
    engine.docker("stop", name, check=True)
    wait_for(lambda: ended(broker, old), what="the old lease ended with its container")
    return old


def test_docker_start_a_waits_for_the_containers_own_device_and_the_lease_follows_it(
        host: Broker, engine: DockerEngine):
    old = made_and_ended(host, engine, "zhang-again", "gpu1")
    other = hold(host, "gpu1")  # someone else holds its device now
    run = None
    try:
        run = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--time", "1h", "--", "/usr/bin/docker",
                                "start", "-a", "zhang-again"], env={**host.env, "DOCKER_HOST": engine.host},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: any(q["devices"] == ["gpu1"] for q in status(host)["queue"]), what="it waits for gpu1")
        assert not running(engine, "zhang-again")
        other.kill()
        other.wait(10)
        new = lease_id_in(next(line for line in run.stderr if "vaccel: lease " in line))  # after the queue's lines
        assert new != old
        holder = wait_for(lambda: (h := holder_of(host, new)) and h["container"] and h, what="the lease follows it")
        assert holder["container"]["name"] == "zhang-again" and holder["pid"] == run.pid
        device = next(d for d in status(host)["devices"] if d["lease_id"] == new)
        assert device["label"] == "gpu1" and running(engine, "zhang-again")
        assert stopped_for(host, "zhang-again") is None  # its old label did not get it stopped
        engine.docker("stop", "zhang-again", check=True)  # its exit ends the new lease
        run.wait(60)
        wait_for(lambda: ended(host, new), what="the new lease ended with the container")
    finally:
        for proc in (other, run):
            if proc is not None:
                proc.kill()
                proc.wait(10)


def test_docker_start_without_a_hands_the_lease_to_the_container_until_release(host: Broker, engine: DockerEngine):
    made_and_ended(host, engine, "zhang-bg", "gpu0")
    r = host.vaccel("run", "--", "/usr/bin/docker", "start", "zhang-bg", env={**host.env, "DOCKER_HOST": engine.host},
                    timeout=120)
    assert r.returncode == 0, r.stderr
    new = lease_id_in(r.stderr)
    assert f"lease {new} is held by container zhang-bg" in r.stderr
    holder = holder_of(host, new)
    assert holder is not None and holder["container"]["name"] == "zhang-bg" and running(engine, "zhang-bg")
    assert host.vaccel("release", new).returncode == 0
    wait_for(lambda: not running(engine, "zhang-bg"), 60, "release stops it")
    assert "stopped container zhang-bg" in host.log.read_text()


def test_docker_start_refuses_device_options_and_containers_not_made_under_vaccel(host: Broker,
                                                                                 engine: DockerEngine):
    made_and_ended(host, engine, "zhang-opts", "gpu0")
    env = {**host.env, "DOCKER_HOST": engine.host}
    r = host.vaccel("run", "--gpus", "1", "--", "/usr/bin/docker", "start", "zhang-opts", env=env)
    assert r.returncode == 2 and "not --gpus" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    engine.docker("create", *engine.image_args(), "--name", "plain-one", IMAGE, "sleep", "600", check=True)
    r = host.vaccel("run", "--", "/usr/bin/docker", "start", "plain-one", env=env)
    assert r.returncode == 2 and "was not made under vaccel run" in r.stderr, r.stderr
    assert not running(engine, "plain-one") and not running(engine, "zhang-opts")


# -- detach: Ctrl-P Ctrl-Q hands the lease to the container -------------------------------------


def test_detaching_from_a_foreground_container_hands_it_the_lease(host: Broker, engine: DockerEngine):
    primary, secondary = pty.openpty()  # docker run -it needs a terminal, and reads Ctrl-P Ctrl-Q from it
    run = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--device", "gpu0", "--", *keep_args(engine),
                            "--rm", "-it", "--name", "fg-detach", IMAGE, "sleep", "600"],
                           env={**host.env, "DOCKER_HOST": engine.host}, stdin=secondary, stdout=secondary,
                           stderr=subprocess.PIPE, text=True)
    os.close(secondary)
    try:
        lease_id = lease_id_in(run.stderr.readline())
        wait_for(lambda: (h := holder_of(host, lease_id)) and h["container"], what="the container named")
        os.write(primary, b"\x10\x11")  # Ctrl-P Ctrl-Q
        assert run.wait(60) == 0
        said = run.stderr.read()
        assert f"vaccel: detached: lease {lease_id} is held by container fg-detach" in said, said
        holder = holder_of(host, lease_id)
        assert holder is not None and holder["pid"] == int(engine.inspect("fg-detach", "{{.State.Pid}}"))
        assert running(engine, "fg-detach")
        assert host.vaccel("release", lease_id).returncode == 0
        wait_for(lambda: not running(engine, "fg-detach"), 60, "release stops it")
    finally:
        run.kill()
        run.wait(10)
        os.close(primary)


def test_detached_run_inside_a_reservation_is_refused_in_one_line(host: Broker, engine: DockerEngine):
    lease_id = json.loads(host.vaccel("reserve", "--device", "gpu0", "--time", "1h", "--json").stdout)["lease_id"]
    r = host.vaccel("run", "--lease", lease_id, "--", *keep_args(engine), "-d", "--name", "in-reservation", IMAGE,
                    "sleep", "600", env={**host.env, "DOCKER_HOST": engine.host})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "reservation alone" in r.stderr and engine.docker("inspect", "in-reservation").returncode != 0
    assert lease_on(host, "gpu0")["lease_id"] == lease_id  # the reservation stays


# -- who holds a busy device, and a rename -----------------------------------------------------


def test_a_busy_device_names_its_user_pid_and_container_and_status_follows_a_rename(
        host: Broker, engine: DockerEngine, inventory: Path):
    engine.docker("run", "-d", *engine.image_args(), "--name", "busy-one", IMAGE, "sleep", "600", check=True)
    pid = int(engine.inspect("busy-one", "{{.State.Pid}}"))
    # The probe reports the container's process on gpu1 (a simulated inventory lists it).
    inventory.write_text(inventory.read_text() + f"processes:\n  - {{device_uuid: {UUIDS[1]}, pid: {pid}}}\n")
    busy = wait_for(lambda: (d := next(d for d in status(host)["devices"] if d["label"] == "gpu1"))["busy_by"] and d,
                    60, "gpu1 busy")
    assert busy["state"] == "busy" and busy["lease_id"] is None
    assert busy["busy_by"] == {"user": "root", "pid": pid, "command": "sleep 600", "container": "busy-one"}
    assert f"root (pid {pid}, container busy-one, no lease)" in host.vaccel("status").stdout
    engine.docker("rename", "busy-one", "busy-two", check=True)
    wait_for(lambda: next(d for d in status(host)["devices"] if d["label"] == "gpu1")["busy_by"]["container"]
             == "busy-two", 60, "busy_by follows the rename")
    assert next(d for d in status(host)["devices"] if d["label"] == "gpu0")["busy_by"] is None

    lease_id = detached(host, engine, "gpu0", "--name", "held-one", IMAGE, "sleep", "600")
    engine.docker("rename", "held-one", "held-two", check=True)
    wait_for(lambda: holder_of(host, lease_id)["container"]["name"] == "held-two", 60, "the holder follows it")
    assert "root (container held-two)" in host.vaccel("status").stdout


def test_a_container_started_again_under_a_new_lease_survives_a_broker_restart(host: Broker, engine: DockerEngine):
    made_and_ended(host, engine, "zhang-kept", "gpu0")
    r = host.vaccel("run", "--", "/usr/bin/docker", "start", "zhang-kept", env={**host.env, "DOCKER_HOST": engine.host},
                    timeout=120)
    assert r.returncode == 0, r.stderr
    new = lease_id_in(r.stderr)
    judged = "the 1 containers running as it connected are judged"
    assert judged not in host.log.read_text()
    host.stop()
    host.start()  # judges every running container as it connects to the engine again
    wait_for(lambda: judged in host.log.read_text(), 60, "the broker judged what runs")
    holder = holder_of(host, new)
    assert holder is not None and holder["container"]["name"] == "zhang-kept" and running(engine, "zhang-kept")
    assert stopped_for(host, "zhang-kept") is None
    assert host.vaccel("release", new).returncode == 0
    wait_for(lambda: not running(engine, "zhang-kept"), 60, "release stops it")


def test_rootful_podman_start_is_the_way_back_too(start_broker, inventory: Path, rootful_podman: RootfulPodman):
    broker = start_broker(inventory, f'[containers]\npodman = "{rootful_podman.host}"\nstop_grace = "1s"\n')
    env = {**broker.env, **rootful_podman.env}
    r = broker.vaccel("run", "--device", "gpu1", "--", "/usr/bin/podman", "run", "-d", "--name", "podman-again",
                      *rootful_podman.image_args(), PODMAN_IMAGE, "sleep", "600", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    old = lease_id_in(r.stderr)
    try:
        rootful_podman.podman("stop", "podman-again", check=True)
        wait_for(lambda: ended(broker, old), what="the lease ended with its container")
        r = broker.vaccel("run", "--", "/usr/bin/podman", "start", "podman-again", env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        new = lease_id_in(r.stderr)
        holder = holder_of(broker, new)
        assert holder is not None and holder["container"]["engine"] == "podman"
        assert next(d for d in status(broker)["devices"] if d["lease_id"] == new)["label"] == "gpu1"
        assert rootful_podman.inspect("podman-again", "{{.State.Running}}") == "true"
        assert broker.vaccel("release", new).returncode == 0
        wait_for(lambda: rootful_podman.inspect("podman-again", "{{.State.Running}}") == "false", 30, "stopped")
    finally:
        rootful_podman.podman("rm", "-f", "podman-again")
