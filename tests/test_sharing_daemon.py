"""Memory shares on a real daemon with real Unix users (issue 35): two users' shares on one
simulated shared device; the memory each process uses comes from the inventory's
usage_file (read at every probe, as NVML's per-process memory would be). The one that
goes over its share is warned through its lease's notice, then stopped and its lease
ends as over_budget; the other is untouched. Needs root (useradd, a root daemon)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Broker
from tests.test_multiuser import as_user, staged, status, wait_for  # noqa: F401 - staged is a fixture

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="multi-user tests need root to create users"),
]

GIB = 1024
INVENTORY = """devices:
  - vendor: nvidia
    name: NVIDIA H100 80GB HBM3
    uuid: GPU-5a10e6e5-95f7-2785-ed63-6f6147f304f7
    memory_mib: 81920
    compute_capability: "9.0"
    driver_version: "535.129.03"
    usage_file: {usage}
  - vendor: nvidia
    name: NVIDIA A100-SXM4-80GB
    uuid: GPU-6f1a0c2e-0000-0000-0000-000000000001
    memory_mib: 81920
    compute_capability: "8.0"
"""
CONFIG = """[leases]
heartbeat_ttl = "3s"
[probe]
refresh_interval = "0.5s"
[sharing]
devices = ["gpu0"]
over_budget_grace = "2s"
"""


@pytest.fixture
def shared_broker(staged: Path, start_broker) -> Iterator[tuple[Broker, Path]]:  # noqa: F811 - the fixture
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-sh-"))
    os.chmod(workdir, 0o755)
    usage = workdir / "usage.json"
    inventory = workdir / "inventory.yaml"
    inventory.write_text(INVENTORY.format(usage=usage))
    broker = start_broker(inventory, CONFIG, workdir=workdir)
    yield broker, usage
    broker.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def use(usage: Path, per_pid: dict[int, int]) -> None:
    """What each process uses now, as the next probe will read it (written whole, then moved in)."""
    partial = usage.with_suffix(".tmp")
    partial.write_text(json.dumps({str(pid): mib for pid, mib in per_pid.items()}))
    partial.replace(usage)


def start_share(broker: Broker, staged: Path, user: str, size: str) -> tuple[subprocess.Popen, str, int, str]:  # noqa: F811
    """`vaccel run --memory SIZE` as `user`: (vaccel run, lease id, the command's pid, its env line)."""
    script = 'echo "$VACCEL_LEASE_ID $$ $VACCEL_MEMORY_SHARE_MIB $VACCEL_MEMORY_CAP_MIB $PYTORCH_CUDA_ALLOC_CONF"; ' \
             "exec sleep 120"
    run = as_user(broker, staged, user, "run", "--memory", size, "--signal", "none", "--", "sh", "-c", script,
                  popen=True)
    line = run.stdout.readline().split()
    assert line and line[0].startswith("l-"), run.stderr.read() if run.poll() is not None else line
    return run, line[0], int(line[1]), " ".join(line[2:])


def test_two_shares_on_one_device_and_the_one_over_budget_is_warned_then_stopped(
        shared_broker: tuple[Broker, Path], staged: Path) -> None:  # noqa: F811
    broker, usage = shared_broker
    alice, alice_lease, alice_pid, alice_env = start_share(broker, staged, "vaccel-alice", "20GiB")
    bob, bob_lease, bob_pid, _ = start_share(broker, staged, "vaccel-bob", "30GiB")
    try:
        # The lease's env caps the allocator below the share (the runtime's context sits outside it).
        assert alice_env == f"{20 * GIB} {20 * GIB - 768} expandable_segments:True,garbage_collection_threshold:0.8"
        device = status(broker)["devices"][0]
        assert (device["sharing"], device["state"], device["lease_id"]) == ("memory", "shared", None)
        assert {(s["user"], s["memory_mib"]) for s in device["shares"]} == {
            ("vaccel-alice", 20 * GIB), ("vaccel-bob", 30 * GIB)}
        assert status(broker)["devices"][1]["sharing"] == "exclusive"
        # A whole-device request does not land on the shared device while it has shares.
        whole = broker.vaccel("run", "--gpus", "2", "--no-wait", "--", "true")
        assert whole.returncode != 0 and "gpu0 shared: vaccel-alice 20 GiB, vaccel-bob 30 GiB" in whole.stderr

        use(usage, {alice_pid: 12 * GIB, bob_pid: 36 * GIB})  # bob goes 6 GiB over his share
        shares = wait_for(lambda: (s := {x["user"]: x for x in status(broker)["devices"][0]["shares"]})
                          and s["vaccel-bob"]["used_mib"] == 36 * GIB and s)
        assert shares["vaccel-alice"]["used_mib"] == 12 * GIB
        text = broker.vaccel("status").stdout
        assert "uses 36 GiB OVER ITS SHARE" in text and "share of 30 GiB" in text, text

        code = bob.wait(30)  # warned, then stopped once the grace is over
        err = bob.stderr.read()
        assert "uses 36 GiB of device memory, over its share of 30 GiB" in err, err
        assert code == 128 + signal.SIGTERM, err
        ended = json.loads(broker.vaccel("leases", "--all", "--ended", "--json").stdout)["leases"]
        assert {lease["id"]: lease["state"] for lease in ended}[bob_lease] == "over_budget"

        # alice: untouched, within her share, her lease and process still there.
        assert alice.poll() is None
        device = status(broker)["devices"][0]
        assert [(s["lease_id"], s["user"]) for s in device["shares"]] == [(alice_lease, "vaccel-alice")]
        assert os.path.exists(f"/proc/{alice_pid}")
        report = json.loads(broker.vaccel("report", "--json", "--by", "user").stdout)
        assert report["total"]["end_reasons"].get("over_budget") == 1
    finally:
        for run in (alice, bob):
            run.terminate()
            run.wait(10)
