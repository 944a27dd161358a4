"""Containers of real users (vaccel-alice, vaccel-bob; tests/test_multiuser.py makes them) under a
root broker that asks the private dockerd of tests/container_engine.py, on the 2-GPU simulated
host of tests/test_containers_run.py:

- container root is uid 0 to the host, not alice: `with lease()` inside alice's container joins
  her lease because the engine and the kernel put it in that lease's container; a process of
  any other container, naming her lease, is refused;
- a second user's container waits in the queue, and starts when the first one's container ends.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Broker
from tests.container_engine import IMAGE, DockerEngine
from tests.test_containers_lease import config_for, holder_of, running, status, wait_for
from tests.test_containers_run import UUIDS, docker_run, gpu_nodes  # noqa: F401 - gpu_nodes: fixture
from tests.test_multiuser import staged  # noqa: F401 - staged: fixture

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="real users, mknod and a private dockerd need root"),
]

JOIN = "import vaccel\nwith vaccel.lease() as held:\n    print(held.id, held.joined, len(held.devices))\n"


@pytest.fixture
def host(start_broker, staged: Path, gpu_nodes: list[str], docker_engine: DockerEngine,  # noqa: F811 - fixtures
         ) -> Iterator[Broker]:
    """A root broker the users reach, and the engine's socket open to them (as the docker group
    would: root-equivalent, which is what docs/containers.md says of docker users)."""
    workdir = Path(subprocess.run(["mktemp", "-d", "/tmp/vct-u-XXXXXX"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    os.chmod(workdir, 0o755)
    inventory = workdir / "inventory.yaml"
    inventory.write_text("devices:\n" + "".join(
        f"  - {{vendor: nvidia, name: Sim GPU, uuid: {uuid}, memory_mib: 16384, compute_capability: '8.0', "
        f"device_nodes: [{node}]}}\n" for uuid, node in zip(UUIDS, gpu_nodes, strict=True)))
    acl = "u:vaccel-alice:rw,u:vaccel-bob:rw"
    subprocess.run(["setfacl", "-m", acl, str(docker_engine.socket)], check=True)
    folder_mode = docker_engine.base.stat().st_mode & 0o7777
    os.chmod(docker_engine.base, folder_mode | 0o011)  # the users reach the socket in it, and see nothing else
    try:
        yield start_broker(inventory, config_for(docker_engine, ttl="5s"), workdir=workdir)
    finally:
        os.chmod(docker_engine.base, folder_mode)
        subprocess.run(["setfacl", "-x", "u:vaccel-alice,u:vaccel-bob", str(docker_engine.socket)], check=False)
        ids = docker_engine.docker("ps", "-aq", "--filter", "label=org.vaccel.user", check=True).stdout.split()
        if ids:
            docker_engine.docker("rm", "-f", *ids)
        subprocess.run(["rm", "-rf", str(workdir)], check=False)


def user_env(broker: Broker, staged: Path, engine: DockerEngine) -> dict[str, str]:  # noqa: F811 - staged: a path
    return {"PATH": "/usr/bin:/bin", "VACCEL_SOCKET": str(broker.socket), "PYTHONPATH": str(staged), "HOME": "/",
            "PYTHONUNBUFFERED": "1", "DOCKER_HOST": engine.host, "DOCKER_CONFIG": "/nonexistent-vaccel-docker"}


def as_user(user: str, env: dict[str, str], *args: str, popen: bool = False):
    cmd = [sys.executable, "-m", "vaccel.cli", "run", *args]
    if popen:
        return subprocess.Popen(cmd, user=user, env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return subprocess.run(cmd, user=user, env=env, cwd="/", capture_output=True, text=True, timeout=120)


def lease_id_of(text: str) -> str:
    found = re.search(r"vaccel: lease (l-[\w-]+)", text)
    assert found, text
    return found.group(1)


def test_container_root_joins_its_own_lease_and_no_other(host: Broker, staged: Path,  # noqa: F811 - fixture
                                                         docker_engine: DockerEngine):
    env = user_env(host, staged, docker_engine)
    r = as_user("vaccel-alice", env, "--gpus", "2", "--", *docker_run(docker_engine, IMAGE, sys.executable, "-c", JOIN))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [lease_id_of(r.stderr), "True", "2"]  # uid 0 inside, joined as alice's container

    held = as_user("vaccel-alice", env, "--device", "gpu0", "--",
                   *docker_run(docker_engine, "--name", "alices", IMAGE, "sleep", "600"), popen=True)
    try:
        lease_id = lease_id_of(held.stderr.readline())
        wait_for(lambda: (h := holder_of(host, lease_id)) and h["container"], what="alice's container named")
        # Another container (root inside, as every Docker container) with alice's lease id and the socket:
        folder = os.path.dirname(host.socket)
        rogue = docker_engine.docker(
            "run", "--rm", *docker_engine.image_args(), "-v", f"{sys.prefix}:{sys.prefix}:ro", "-v",
            f"{staged}:{staged}:ro", "--mount", f"type=bind,src={folder},dst={folder}", "-e", f"PYTHONPATH={staged}",
            "-e", f"VACCEL_LEASE_ID={lease_id}", "-e", f"VACCEL_SOCKET={host.socket}", IMAGE, sys.executable, "-c",
            JOIN)
        assert rogue.returncode != 0
        assert "only its holder's processes may join it (and those of the container it was applied to)" in \
            rogue.stderr, rogue.stderr
        assert holder_of(host, lease_id)["user"] == "vaccel-alice"
    finally:
        held.terminate()
        held.wait(30)


def test_a_second_users_container_waits_then_starts_when_the_first_ends(host: Broker,
                                                                       staged: Path,  # noqa: F811 - fixture
                                                                       docker_engine: DockerEngine):
    env = user_env(host, staged, docker_engine)
    alice = as_user("vaccel-alice", env, "--gpus", "2", "--",
                    *docker_run(docker_engine, "--name", "alice-first", IMAGE, "sleep", "600"), popen=True)
    bob = None
    try:
        alice_lease = lease_id_of(alice.stderr.readline())
        wait_for(lambda: (h := holder_of(host, alice_lease)) and h["container"], what="alice's container named")
        bob = as_user("vaccel-bob", env, "--gpus", "1", "--",
                      *docker_run(docker_engine, "--name", "bob-second", IMAGE, "echo", "started"), popen=True)
        wait_for(lambda: [q["requester"]["user"] for q in status(host)["queue"]] == ["vaccel-bob"],
                 what="bob waiting")
        assert docker_engine.docker("inspect", "bob-second").returncode != 0  # not even created while he waits
        docker_engine.docker("stop", "alice-first", check=True)  # alice's container ends: her lease with it
        out, err = bob.communicate(timeout=60)
        assert bob.returncode == 0, err
        assert out.strip() == "started"
        assert alice.wait(30) != 0
        ended = json.loads(host.vaccel("leases", "--all", "--ended", "--json").stdout)["leases"]
        by_user = {lease["holder"]["user"]: lease for lease in ended}
        assert by_user["vaccel-alice"]["state"] in ("holder_exited", "released")
        assert by_user["vaccel-bob"]["granted_at"] >= by_user["vaccel-alice"]["ended_at"]
    finally:
        for run in (alice, bob):
            if run is not None and run.poll() is None:
                run.kill()
                run.wait(10)


def test_an_admins_revoke_stops_a_users_detached_container(host: Broker, staged: Path,  # noqa: F811 - fixture
                                                           docker_engine: DockerEngine):
    env = user_env(host, staged, docker_engine)
    r = as_user("vaccel-alice", env, "--device", "gpu1", "--",
                *docker_run(docker_engine, "-d", "--name", "alice-notebook", IMAGE, "sleep", "600"))
    assert r.returncode == 0, r.stderr
    lease_id = lease_id_of(r.stderr)
    assert holder_of(host, lease_id)["container"]["name"] == "alice-notebook"
    r = host.vaccel("release", lease_id, "--reason", "the GPU is needed for the exam")  # root: a revoke
    assert r.returncode == 0 and "revoked" in r.stdout, r.stdout + r.stderr
    wait_for(lambda: not running(docker_engine, "alice-notebook"), 30, "alice's container stopped")
    assert [d["state"] for d in status(host)["devices"]] == ["free", "free"]
