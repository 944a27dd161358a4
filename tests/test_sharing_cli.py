"""Sharing a big GPU through the CLI against a real daemon (issue 35), as one user: MIG
instances leased and shown under their GPU with the MIG uuid as the visible device, a
share waiting for memory in the queue, and the refusals a user can cause, each one line
with its exit status."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from tests.conftest import Broker
from tests.test_multiuser import wait_for

INVENTORY = """devices:
  - vendor: nvidia
    name: NVIDIA A100-SXM4-80GB
    uuid: GPU-a100
    memory_mib: 81920
    compute_capability: "8.0"
  - vendor: nvidia
    name: NVIDIA H100 80GB HBM3
    uuid: GPU-h100
    memory_mib: 81559
    compute_capability: "9.0"
    mig:
      - {profile: 3g.40gb, uuid: MIG-h100-0, memory_mib: 40192}
      - {profile: 1g.10gb, uuid: MIG-h100-1, memory_mib: 9856}
"""
CONFIG = """[leases]
heartbeat_ttl = "3s"
[probe]
refresh_interval = "1s"
[sharing]
devices = ["gpu0"]
"""


def sharing_broker(start_broker, tmp_path: Path) -> Broker:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    return start_broker(inventory, CONFIG)


def test_mig_instances_are_leased_and_shown_under_their_gpu(start_broker, tmp_path: Path) -> None:
    broker = sharing_broker(start_broker, tmp_path)
    run = broker.vaccel("run", "--device", "gpu1.1", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "MIG-h100-1"  # the runtime is given the instance's MIG uuid
    assert "gpu1.1 NVIDIA H100 80GB HBM3 MIG 1g.10gb" in run.stderr
    text = broker.vaccel("status").stdout
    lines = {line.split()[0]: line for line in text.splitlines()[1:5] if line.strip()}
    assert "MIG mode, 2 instances" in lines["gpu1"]
    assert "3g.40gb instance" in lines["gpu1.0"] and "39.2 GiB" in lines["gpu1.0"]
    assert "gpu0" in lines and "80 GiB of 80 GiB free for shares" in lines["gpu0"]
    devices = json.loads(broker.vaccel("status", "--json").stdout)["devices"]
    assert [(d["label"], d["sharing"], d["parent_uuid"], d["mig_profile"]) for d in devices] == [
        ("gpu0", "memory", "", ""), ("gpu1.0", "mig", "GPU-h100", "3g.40gb"), ("gpu1.1", "mig", "GPU-h100", "1g.10gb")]


def test_a_share_that_does_not_fit_waits_and_says_why(start_broker, tmp_path: Path) -> None:
    broker = sharing_broker(start_broker, tmp_path)
    first = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--memory", "60GiB", "--", "sleep", "60"],
                             env=broker.env, stderr=subprocess.PIPE, text=True)
    second = None
    try:
        wait_for(lambda: json.loads(broker.vaccel("status", "--json").stdout)["devices"][0]["shares"])
        second = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--memory", "30GiB", "--", "true"],
                                  env=broker.env, stderr=subprocess.PIPE, text=True)
        queue = wait_for(lambda: json.loads(broker.vaccel("status", "--json").stdout)["queue"])
        assert queue[0]["memory_mib"] == 30 * 1024
        assert queue[0]["reason"].startswith("waiting for 30 GiB of shared memory to come free (most free now: "
                                             "gpu0, 20 GiB)"), queue
        assert "wants a 30 GiB share" in broker.vaccel("status").stdout
        first.terminate()
        assert second.wait(30) == 0, second.stderr.read()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)


def test_refusals_a_user_can_cause_are_one_line_with_their_exit_status(start_broker, tmp_path: Path,
                                                                        broker: Broker) -> None:
    shared = sharing_broker(start_broker, tmp_path)
    both = shared.vaccel("run", "--memory", "20GiB", "--gpus", "2", "--", "true")
    assert both.returncode == 2 and both.stderr.count("\n") == 1, both.stderr
    assert "--memory asks for a share of one GPU, --gpus 2 for whole GPUs" in both.stderr
    bare = shared.vaccel("run", "--memory", "20", "--", "true")
    assert bare.returncode == 2 and "--memory 20: give a unit" in bare.stderr
    huge = shared.vaccel("run", "--memory", "100GiB", "--", "true")
    assert huge.returncode == 1 and "more than any shared device holds" in huge.stderr, huge.stderr
    unshared = broker.vaccel("run", "--memory", "20GiB", "--", "true")  # the lab server shares nothing
    assert unshared.returncode == 1 and unshared.stderr.count("\n") == 1, unshared.stderr
    assert "no device on this host is shared by memory ([sharing] devices)" in unshared.stderr


def test_shares_survive_a_kill_9_of_the_daemon(start_broker, tmp_path: Path) -> None:
    broker = sharing_broker(start_broker, tmp_path)
    booked = [json.loads(broker.vaccel("reserve", "--memory", size, "--time", "1h", "--json").stdout)
              for size in ("20GiB", "30GiB")]
    assert [b["share_mib"] for b in booked] == [20 * 1024, 30 * 1024]
    broker.kill9()
    broker.start()
    device = json.loads(broker.vaccel("status", "--json").stdout)["devices"][0]
    assert sorted((s["lease_id"], s["memory_mib"]) for s in device["shares"]) == sorted(
        (b["lease_id"], b["share_mib"]) for b in booked)
    over = broker.vaccel("reserve", "--memory", "40GiB", "--time", "1h", "--no-wait")
    assert over.returncode == 75 and "30 GiB free" in over.stderr, over.stderr  # 80 - 20 - 30 after the restart


def test_a_reload_shares_a_device_and_unshares_it(start_broker, tmp_path: Path) -> None:
    broker = sharing_broker(start_broker, tmp_path)
    broker.config.write_text(CONFIG.replace('devices = ["gpu0"]', 'devices = ["gpu1"]'))  # the MIG GPU's instances
    broker.proc.send_signal(signal.SIGHUP)
    sharing = wait_for(lambda: (d := json.loads(broker.vaccel("status", "--json").stdout)["devices"])
                       and d[0]["sharing"] == "exclusive" and [x["sharing"] for x in d])
    assert sharing == ["exclusive", "memory", "memory"]
    run = broker.vaccel("run", "--memory", "4GiB", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    assert run.returncode == 0 and run.stdout.strip() == "MIG-h100-1", run.stderr  # best fit: the 1g.10gb
