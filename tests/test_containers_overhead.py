"""What `vaccel run -- docker run ...` does beside the engine's own run, against a real private
dockerd and a real broker (issue 45: a short container's run cost 1.42x the bare `docker run`;
bench/container_overhead.py has the figures). Each test pins one cost that is gone:
- the container is named to the broker (AttachContainer) over the identity socket, as the grant
  and the release are, so the run never imports grpc nor opens a channel (the heartbeat would:
  the broker here asks for one only every few minutes), whether the run takes the quick path
  (vaccel/run/quick_container.py) or the full CLI (an option the quick path does not read);
- once a foreground container's engine client has returned, the engine is asked again whether
  the container still runs only when its user could have detached from it (stdin attached).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Broker
from tests.container_engine import IMAGE, DockerEngine
from tests.test_containers_lease import config_for, holder_of, lease_id_in, wait_for
from tests.test_containers_run import UUIDS, docker_run, gpu_nodes  # noqa: F401 - gpu_nodes: fixture

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and a private dockerd need root")


@pytest.fixture
def host(start_broker, gpu_nodes: list[str], docker_engine: DockerEngine,  # noqa: F811 - gpu_nodes: fixture
         tmp_path: Path) -> Broker:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("devices:\n" + "".join(
        f"  - {{vendor: nvidia, name: Sim GPU, uuid: {uuid}, memory_mib: 16384, compute_capability: '8.0', "
        f"device_nodes: [{node}]}}\n" for uuid, node in zip(UUIDS, gpu_nodes, strict=True)))
    return start_broker(inventory, config_for(docker_engine, ttl="600s"))  # no heartbeat within a test


def imported(stderr: str) -> set[str]:
    """The modules `python -X importtime` says the process imported."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("options, path", [([], "vaccel.run.quick_container"),
                                            (["--wait", "1h"], "vaccel.containers.hold")], ids=["quick", "full-cli"])
def test_the_container_is_named_to_the_broker_without_grpc(host: Broker, docker_engine: DockerEngine,
                                                          options: list[str], path: str):
    command = [sys.executable, "-X", "importtime", "-m", "vaccel.entry", "run", *options, "--",
               *docker_run(docker_engine, "--name", "named-aside", IMAGE, "sleep", "600")]
    run = subprocess.Popen(command, env={**host.env, "DOCKER_HOST": docker_engine.host}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        said = ""
        for line in run.stderr:  # type: ignore[union-attr]
            said += line
            if "vaccel: lease l-" in line:
                break
        lease_id = lease_id_in(said)
        wait_for(lambda: (holder_of(host, lease_id) or {}).get("container"), 60, "the lease follows the container")
        assert holder_of(host, lease_id)["container"]["name"] == "named-aside"  # type: ignore[index]
        docker_engine.docker("kill", "named-aside", check=True)
        said += run.communicate(timeout=60)[1]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    modules = imported(said)
    assert path in modules  # that path ran, and importtime saw it
    assert "grpc" not in modules, "the run imported grpc"
    assert run.returncode == 137  # the container's status (killed)


# What a short container's quick run imports none of (python -X importtime of the run):
# grpc and protobuf (the grant is read from its bytes), typing (~7 ms: the records are
# vaccel_common/record.py's), csv and re (~7 ms: only a --mount or a path with a comma needs them).
NOT_ON_THE_QUICK_PATH = ("grpc", "google.protobuf", "typing", "csv", "re", "vaccel_common.units")


def test_a_short_containers_quick_run_imports_none_of_the_slow_modules(host: Broker, docker_engine: DockerEngine):
    command = [sys.executable, "-X", "importtime", "-m", "vaccel.entry", "run", "-q", "--",
               *docker_run(docker_engine, IMAGE, "true")]
    r = subprocess.run(command, env={**host.env, "DOCKER_HOST": docker_engine.host}, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    modules = imported(r.stderr)
    assert "vaccel.run.quick_container" in modules and "vaccel.run.runner" not in modules  # the container ended quickly
    assert [m for m in NOT_ON_THE_QUICK_PATH if m in modules] == []


def engine_client_logging_its_calls(folder: Path) -> tuple[Path, Path]:
    """A `docker` that writes each of its command lines to a log, then is Debian's docker."""
    log, program = folder / "calls.log", folder / "docker"
    program.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec /usr/bin/docker "$@"\n')
    program.chmod(0o755)
    return program, log


@pytest.mark.parametrize("stdin", [False, True], ids=["no-stdin", "stdin-attached"])
def test_the_engine_is_asked_after_the_container_only_when_it_could_have_been_detached_from(
        host: Broker, docker_engine: DockerEngine, tmp_path: Path, stdin: bool):
    program, log = engine_client_logging_its_calls(tmp_path)
    command = [str(program), *docker_run(docker_engine, *(["-i"] if stdin else []), IMAGE, "true")[1:]]
    r = host.vaccel("run", "--", *command, env={**host.env, "DOCKER_HOST": docker_engine.host},
                    stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("run ")
    # Without stdin the user cannot have detached (Ctrl-P Ctrl-Q comes through it): the container
    # ended with its client. With it, the engine is asked whether it runs on (then it holds the lease).
    assert [c.split()[0] for c in calls[1:]] == (["inspect"] if stdin else [])
