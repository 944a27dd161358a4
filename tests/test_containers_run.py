"""`vaccel run -- docker run ...` against a real private dockerd (tests/container_engine.py)
and a real broker on a 2-GPU simulated host whose devices have real character nodes.

The nodes carry the GPU driver's major (195) with minors no driver answers to, so an open
that the container is allowed gives ENXIO, one it is not allowed gives EPERM, and a node the
container was not given is simply not there. The image borrows the host's /usr; the test
venv and the checkout are mounted read-only at their own paths, so the real client runs inside.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, Broker
from tests.container_engine import DockerEngine

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and a private dockerd need root")

GPU_MAJOR = 195  # the major of the real driver's nodes: is_gpu_node tells them by it
UUIDS = ("GPU-c0ffee00-0000-0000-0000-000000000000", "GPU-c0ffee00-0000-0000-0000-000000000001")
# What a process in the container reports: the node folder's entries, what open(2) says to
# each of the host's nodes, and the lease's variables.
PROBE = """
import errno, json, os, sys
folder, nodes = sys.argv[1], sys.argv[2:]
def try_open(path):
    try:
        os.close(os.open(path, os.O_RDWR))
        return "opened"
    except OSError as e:
        return errno.errorcode[e.errno]
print(json.dumps({"listed": sorted(os.listdir(folder)) if os.path.isdir(folder) else [],
                  "open": {n: try_open(n) for n in nodes},
                  "env": {k: v for k, v in os.environ.items() if k.startswith(("VACCEL_", "CUDA_", "NVIDIA_"))}}))
"""


@pytest.fixture(scope="module")
def gpu_nodes() -> Iterator[list[str]]:
    folder = Path(tempfile.mkdtemp(prefix="vct-nodes-", dir="/tmp"))
    os.chmod(folder, 0o755)
    nodes = []
    for minor in (0, 1):
        path = folder / f"gpu{minor}"
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(GPU_MAJOR, 250 + minor))
        nodes.append(str(path))
    yield nodes
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def host(start_broker, gpu_nodes: list[str], tmp_path: Path) -> Broker:
    """A broker on two simulated GPUs, each with its node."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("devices:\n" + "".join(
        f"  - {{vendor: nvidia, name: Sim GPU, uuid: {uuid}, memory_mib: 16384, compute_capability: '8.0', "
        f"device_nodes: [{node}]}}\n" for uuid, node in zip(UUIDS, gpu_nodes, strict=True)))
    return start_broker(inventory)


def vaccel_run(broker: Broker, engine: DockerEngine, *args: str, timeout: float = 120
               ) -> subprocess.CompletedProcess[str]:
    """`vaccel run ARGS` with the engine's client environment (DOCKER_HOST)."""
    return broker.vaccel("run", *args, env={**broker.env, "DOCKER_HOST": engine.host}, timeout=timeout)


def docker_run(engine: DockerEngine, *args: str) -> list[str]:
    """`docker run --rm` of the test image with the venv and the checkout mounted."""
    mounts = [w for path in (sys.prefix, str(ROOT)) for w in ("-v", f"{path}:{path}:ro")]
    return ["/usr/bin/docker", "run", "--rm", *engine.image_args(), *mounts, *args]


def lease_id_of(stderr: str) -> str:
    found = re.search(r"vaccel: lease (l-[\w-]+)", stderr)
    assert found, stderr
    return found.group(1)


def containers_of_leases(engine: DockerEngine) -> list[str]:
    return engine.docker("ps", "-aq", "--filter", "label=org.vaccel.lease", check=True).stdout.split()


def test_the_container_sees_exactly_its_leased_node_and_the_lease(host: Broker, docker_engine: DockerEngine,
                                                                  gpu_nodes: list[str]):
    folder = os.path.dirname(gpu_nodes[0])
    r = vaccel_run(host, docker_engine, "--device", "gpu1", "--",
                   *docker_run(docker_engine, "vaccel-hostusr:latest", sys.executable, "-c", PROBE, folder, *gpu_nodes))
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["listed"] == ["gpu1"]
    assert seen["open"] == {gpu_nodes[0]: "ENOENT", gpu_nodes[1]: "ENXIO"}  # ENXIO: allowed, and no driver
    assert seen["env"]["VACCEL_LEASE_ID"] == lease_id_of(r.stderr)
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == seen["env"]["VACCEL_DEVICES"] == UUIDS[1]
    assert seen["env"]["VACCEL_SOCKET"] == str(host.socket)
    assert seen["env"]["NVIDIA_VISIBLE_DEVICES"] == "void"  # simulated: no vendor runtime may add a real GPU


def test_the_containers_exit_status_is_vaccel_runs_and_the_lease_ends_with_it(host: Broker,
                                                                               docker_engine: DockerEngine):
    r = vaccel_run(host, docker_engine, "--", *docker_run(docker_engine, "vaccel-hostusr:latest", "sh", "-c", "exit 3"))
    assert r.returncode == 3, r.stderr
    shown = json.loads(host.vaccel("status", "--json").stdout)
    assert [d["state"] for d in shown["devices"]] == ["free", "free"]


def test_with_lease_inside_the_container_joins_the_same_lease(host: Broker, docker_engine: DockerEngine):
    code = "import vaccel\nwith vaccel.lease() as held:\n    print(held.id, held.joined, len(held.devices))\n"
    r = vaccel_run(host, docker_engine, "--gpus", "2", "--",
                   *docker_run(docker_engine, "vaccel-hostusr:latest", sys.executable, "-c", code))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [lease_id_of(r.stderr), "True", "2"]


@pytest.mark.parametrize("options, says", [
    (["--gpus", "all"], "docker run --gpus all: vaccel gives the container the leased GPUs itself"),
    (["--privileged"], "docker run --privileged gives the container every device"),
    (["-e", "CUDA_VISIBLE_DEVICES=0"], "vaccel sets CUDA_VISIBLE_DEVICES"),
    (["--device", "GPU_NODE_0"], "is a GPU device node"),
])
def test_refused_arguments_start_nothing(host: Broker, docker_engine: DockerEngine, gpu_nodes: list[str],
                                         options: list[str], says: str):
    options = [gpu_nodes[0] if o == "GPU_NODE_0" else o for o in options]
    before = containers_of_leases(docker_engine)
    r = vaccel_run(host, docker_engine, "--", *docker_run(docker_engine, *options, "vaccel-hostusr:latest", "true"))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and says in r.stderr and "Traceback" not in r.stderr
    assert containers_of_leases(docker_engine) == before
    assert " grant " not in host.log.read_text()  # refused before any lease was asked for
