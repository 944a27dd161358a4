"""Inside a container or pod that its runtime gave GPUs and that reaches no broker, those GPUs
are the lease (client/vaccel/containers/job.py): on a fake root with real character nodes of the
GPU driver's major (no driver behind them: a simulated lease), then in a real `docker run
--device` of the private dockerd (tests/container_engine.py), as `docker run --gpus 1` would
give a GPU, with no broker socket in the container.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from pathlib import Path

import pytest
from vaccel.containers import job as container_job
from vaccel.session.lease import LeaseError

from tests.container_engine import IMAGE, DockerEngine
from tests.test_containers_run import docker_run, gpu_nodes  # noqa: F401 - gpu_nodes: fixture
from vaccel_common import backends

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")

GPU_MAJOR = 195


def fake_root(tmp_path: Path, count: int) -> str:
    (tmp_path / "dev").mkdir()
    for n in range(count):
        os.mknod(tmp_path / "dev" / f"nvidia{n}", stat.S_IFCHR | 0o666, os.makedev(GPU_MAJOR, 240 + n))
    os.mknod(tmp_path / "dev" / "nvidiactl", stat.S_IFCHR | 0o666, os.makedev(GPU_MAJOR, 255))  # no device
    return str(tmp_path)


@pytest.fixture(autouse=True)
def fresh_cache():
    container_job._cache.clear()
    yield
    container_job._cache.clear()


def test_a_pods_gpus_are_its_lease(tmp_path: Path):
    """A Kubernetes pod with nvidia.com/gpu: 2: the device plugin lists the UUIDs."""
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}
    held = container_job.container_lease(tmp_path / "none.sock", env, fake_root(tmp_path, 2))
    assert held is not None and held.id == f"container-{socket.gethostname()}"
    assert [(d.uuid, d.visible_id) for d in held.devices] == [("GPU-aaaa", "0"), ("GPU-bbbb", "1")]
    assert held.backend == "cuda" and held.simulated  # no driver behind the nodes
    assert held.env["CUDA_VISIBLE_DEVICES"] == "0,1" and held.env["VACCEL_LEASE_ID"] == held.id


def test_none_outside_a_container_with_no_gpu_with_a_broker_or_a_vaccel_lease(tmp_path: Path):
    root = fake_root(tmp_path, 1)
    docker = {"container": "docker"}
    assert container_job.container_lease(tmp_path / "none.sock", {}, root) is None  # no mark of a container
    (tmp_path / ".dockerenv").touch()
    assert container_job.container_lease(tmp_path / "none.sock", {}, root) is not None  # Docker's mark
    container_job._cache.clear()
    assert container_job.container_lease(tmp_path / "none.sock", {**docker, "VACCEL_CONTAINER": "off"}, root) is None
    assert container_job.container_lease(tmp_path / "none.sock", {**docker, "VACCEL_LEASE_ID": "l-1"}, root) is None
    (tmp_path / "empty").mkdir()
    assert container_job.container_lease(tmp_path / "none.sock", docker, str(tmp_path / "empty")) is None
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(tmp_path / "broker.sock"))
    listening.listen()
    try:  # a broker reachable from the container: it is asked, as anywhere
        assert container_job.container_lease(tmp_path / "broker.sock", docker, root) is None
    finally:
        listening.close()


def test_asking_for_more_than_the_container_was_given_fails_at_once(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("container", "podman")
    monkeypatch.setenv("VACCEL_SOCKET", str(tmp_path / "none.sock"))
    monkeypatch.delenv("VACCEL_LEASE_ID", raising=False)
    root = fake_root(tmp_path, 1)
    monkeypatch.setattr(container_job, "devices_given", lambda _root="/": backends.devices_given(root))
    with pytest.raises(LeaseError, match="was given 1 GPU"):
        container_job.lease_for(2, contract=None, config=None, socket=None, in_process=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="a private dockerd needs root")
def test_lease_and_init_accelerator_in_a_plain_docker_run_with_a_gpu(docker_engine: DockerEngine,
                                                                     gpu_nodes: list[str],  # noqa: F811 - fixture
                                                                     tmp_path: Path):
    spec = tmp_path / "runtime-spec.yaml"
    spec.write_text("required_features:\n  - min_memory: 1GiB\n")
    os.chmod(tmp_path, 0o755)
    code = ("import json, os, vaccel\n"
            f"with vaccel.lease(contract={str(spec)!r}) as held:\n"
            "    accelerator = vaccel.init_accelerator()\n"
            "    print(json.dumps({'id': held.id, 'devices': [d.uuid for d in held.devices],\n"
            "                      'visible': os.environ['CUDA_VISIBLE_DEVICES'], 'device': str(accelerator.device),\n"
            "                      'warnings': held.warnings}))\n")
    r = docker_engine.docker(*docker_run(docker_engine, "--device", f"{gpu_nodes[1]}:/dev/nvidia0", "-v",
                                         f"{tmp_path}:{tmp_path}:ro", IMAGE, sys.executable, "-c", code)[1:],
                             timeout=180)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    assert seen["id"].startswith("container-") and seen["devices"] == ["/dev/nvidia0"] and seen["visible"] == "0"
    assert seen["device"] == "cpu"  # a node with no driver behind it: simulated, computed on the CPU
    assert any("was NOT checked" in w for w in seen["warnings"]), seen["warnings"]
