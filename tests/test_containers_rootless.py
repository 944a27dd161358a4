"""Rootless podman, the governed case (docs/containers.md): a real user (vaccel-ctuser, with a
subuid range) runs `vaccel run -- podman run ...` against a root broker with `[enforce] mode =
"acl"`. Container root is that user on the host, so the kernel gates the GPU nodes by their
ACLs inside the container as outside: the leased node opens, the other does not, even when the
user bind-mounts the node folder (rootless containers have no devices cgroup on cgroup v1).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Broker
from tests.container_engine import PODMAN_IMAGE
from tests.podman_engine import RootlessPodman
from tests.test_containers_run import PROBE, UUIDS, lease_id_of
from tests.test_multiuser import staged  # noqa: F401 - staged: fixture

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="a real user, mknod and ACLs on root's nodes need root"),
]
pytest.importorskip("posix1e", reason="pylibacl is not installed (scripts/setup.sh installs vaccel[enforce])")

CONFIG = '[leases]\nheartbeat_ttl = "5s"\n[probe]\nrefresh_interval = "1s"\n[enforce]\nmode = "acl"\ngrace = "1s"\n'


@pytest.fixture
def governed(start_broker, rootless_podman: RootlessPodman) -> Iterator[tuple[Broker, list[str]]]:
    """A root broker gating two simulated GPUs' nodes (0660 root:root, as enforcement wants them)."""
    folder = Path(tempfile.mkdtemp(prefix="vct-acl-", dir="/tmp"))
    os.chmod(folder, 0o755)  # the user's client must reach the socket, and podman the nodes
    nodes = []
    for minor in (0, 1):
        path = folder / f"gpu{minor}"
        os.mknod(path, stat.S_IFCHR | 0o660, os.makedev(195, 252 + minor))
        os.chmod(path, 0o660)
        nodes.append(str(path))
    inventory = folder / "inventory.yaml"
    inventory.write_text("devices:\n" + "".join(
        f"  - {{vendor: nvidia, name: Sim GPU, uuid: {uuid}, memory_mib: 16384, compute_capability: '8.0', "
        f"device_nodes: [{node}]}}\n" for uuid, node in zip(UUIDS, nodes, strict=True)))
    os.chmod(inventory, 0o644)
    workdir = Path(tempfile.mkdtemp(prefix="vct-acl-b-", dir="/tmp"))  # apart: the container gets its run/
    os.chmod(workdir, 0o755)
    broker = start_broker(inventory, CONFIG, workdir=workdir)
    yield broker, nodes
    broker.stop()
    for path in (folder, workdir):
        shutil.rmtree(path, ignore_errors=True)


def test_rootless_container_root_opens_only_the_leased_node(governed, rootless_podman: RootlessPodman,
                                                            staged: Path):  # noqa: F811 - staged: fixture
    broker, nodes = governed
    folder = os.path.dirname(nodes[0])
    env = {**rootless_podman.env, "VACCEL_SOCKET": str(broker.socket), "PYTHONPATH": str(staged),
           "PYTHONUNBUFFERED": "1"}
    # The node folder mounted as well: only the ACLs stand between the container and gpu0.
    podman = ["/usr/bin/podman", "run", "--rm", *rootless_podman.image_args(), "-v", f"{folder}:/host-nodes:ro",
              PODMAN_IMAGE, "python3", "-c", PROBE, folder, *nodes, "/host-nodes/gpu0", "/host-nodes/gpu1"]
    r = rootless_podman.run_as_user([sys.executable, "-m", "vaccel.cli", "run", "--device", "gpu1", "--", *podman],
                                    env=env)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["listed"] == ["gpu1"]
    assert seen["open"] == {nodes[0]: "ENOENT", nodes[1]: "ENXIO",  # ENXIO: allowed, and no driver behind it
                            "/host-nodes/gpu0": "EACCES", "/host-nodes/gpu1": "ENXIO"}
    assert seen["env"]["VACCEL_LEASE_ID"] == lease_id_of(r.stderr)
    # Without a lease, the same container opens neither.
    bare = rootless_podman.podman("run", "--rm", *rootless_podman.image_args(), "-v", f"{folder}:/host-nodes:ro",
                                  PODMAN_IMAGE, "python3", "-c", PROBE, "/host-nodes", "/host-nodes/gpu0",
                                  "/host-nodes/gpu1", check=True)
    assert json.loads(bare.stdout)["open"] == {"/host-nodes/gpu0": "EACCES", "/host-nodes/gpu1": "EACCES"}


def test_a_rootless_detached_container_holds_its_lease_and_a_release_stops_it(
        governed, rootless_podman: RootlessPodman, staged: Path):  # noqa: F811 - staged: fixture
    """No engine for the broker to ask: the user's podman reports the container's init pid, the
    kernel confirms it is the init of a pid namespace of the user's own processes."""
    broker, _ = governed
    env = {**rootless_podman.env, "VACCEL_SOCKET": str(broker.socket), "PYTHONPATH": str(staged),
           "PYTHONUNBUFFERED": "1"}
    podman = ["/usr/bin/podman", "run", "-d", "--name", "rootless-held", *rootless_podman.image_args(),
              PODMAN_IMAGE, "sleep", "600"]
    r = rootless_podman.run_as_user([sys.executable, "-m", "vaccel.cli", "run", "--device", "gpu0", "--", *podman],
                                    env=env)
    assert r.returncode == 0, r.stderr
    lease_id = lease_id_of(r.stderr)
    init = int(rootless_podman.inspect("rootless-held", "{{.State.Pid}}"))
    holder = next(d["holder"] for d in json.loads(broker.vaccel("status", "--json").stdout)["devices"]
                  if d["lease_id"] == lease_id)
    assert holder["pid"] == init and holder["user"] == "vaccel-ctuser"
    assert {k: holder["container"][k] for k in ("name", "engine")} == {"name": "rootless-held",
                                                                       "engine": "podman-rootless"}
    r = rootless_podman.run_as_user([sys.executable, "-m", "vaccel.cli", "release", lease_id], env=env)
    assert r.returncode == 0, r.stderr
    def running() -> str:  # an inspect while podman stops it may fail for a moment: ask again
        return rootless_podman.podman("inspect", "--format", "{{.State.Running}}", "rootless-held").stdout.strip()

    deadline = time.monotonic() + 30
    while running() != "false" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running() == "false"
