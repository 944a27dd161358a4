"""The daemon follows the devices' truth: a device that turns unhealthy or vanishes is not
granted again and its holder is told; one that comes back returns to the pool; a device
used by a process that holds no lease is not granted and `vaccel status` names the user."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.conftest import LAB_INVENTORY, Broker
from tests.test_broker_integration import leased, status, wait_for

HOLDER = """
import sys, vaccel
with vaccel.lease(on_lost=lambda l, why: print("lost:", why, flush=True)) as l:
    print(l.devices[0].uuid, flush=True)
    sys.stdin.readline()
"""


def edit(path: Path, change) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    tmp.replace(path)  # atomic: the probe never reads half a file


def device_of(broker: Broker, uuid: str) -> dict:
    return next(d for d in status(broker)["devices"] if d["uuid"] == uuid)


def test_unhealthy_device_ends_its_lease_and_returns_when_healthy(start_broker, tmp_path: Path):
    inventory = tmp_path / "lab.yaml"
    shutil.copy(LAB_INVENTORY, inventory)
    broker = start_broker(inventory)
    holder = subprocess.Popen([broker.python, "-c", HOLDER], env=broker.env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    uuid = holder.stdout.readline().strip()

    def sicken(doc, healthy=False):
        for d in doc["devices"]:
            if d["uuid"] == uuid:
                d["healthy"] = healthy
                d["health_reason"] = "" if healthy else "uncorrectable ECC errors"

    edit(inventory, sicken)
    told = holder.stdout.readline()
    assert told.startswith("lost:") and "ECC" in told
    assert device_of(broker, uuid)["state"] == "unhealthy"
    r = broker.vaccel("run", "--gpus", "4", "--no-wait", "--", "true")
    assert r.returncode == 75, "an unhealthy device is never granted (but may come back: no hard refusal)"
    edit(inventory, lambda doc: sicken(doc, healthy=True))
    wait_for(lambda: device_of(broker, uuid)["state"] == "free")
    assert broker.vaccel("run", "--gpus", "4", "--no-wait", "--", "true").returncode == 0
    holder.communicate("\n", timeout=30)


def test_vanished_device_ends_its_lease(start_broker, tmp_path: Path):
    inventory = tmp_path / "lab.yaml"
    shutil.copy(LAB_INVENTORY, inventory)
    broker = start_broker(inventory)
    holder = subprocess.Popen([broker.python, "-c", HOLDER], env=broker.env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    uuid = holder.stdout.readline().strip()
    edit(inventory, lambda doc: doc.update(devices=[d for d in doc["devices"] if d["uuid"] != uuid]))
    told = holder.stdout.readline()
    assert told.startswith("lost:") and "disappeared" in told
    assert uuid not in {d["uuid"] for d in status(broker)["devices"]}
    holder.communicate("\n", timeout=30)


def test_gpu_use_without_a_lease_blocks_the_device_and_is_reported(start_broker, tmp_path: Path):
    inventory = tmp_path / "lab.yaml"
    shutil.copy(LAB_INVENTORY, inventory)
    broker = start_broker(inventory)
    doc = yaml.safe_load(inventory.read_text())
    foreign_gpu = doc["devices"][0]["uuid"]
    # A real process of this user "on" gpu0, started without any lease.
    stray = subprocess.Popen(["sleep", "60"])
    # And a process inside a lease, on its own leased device: that one is fine.
    run = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "sh", "-c",
                            "echo $VACCEL_DEVICES; exec sleep 60"], env=broker.env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        leased_gpu = run.stdout.readline().strip()
        leased_pid = int(subprocess.check_output(["pgrep", "-P", str(run.pid)]).split()[0])
        edit(inventory, lambda d: d.update(processes=[
            {"device_uuid": foreign_gpu, "pid": stray.pid, "used_memory_mib": 1024},
            {"device_uuid": leased_gpu, "pid": leased_pid, "used_memory_mib": 2048},
        ]))
        wait_for(lambda: status(broker)["unleased_processes"])
        data = status(broker)
        assert [p["pid"] for p in data["unleased_processes"]] == [stray.pid]
        stray_entry = data["unleased_processes"][0]
        assert stray_entry["user"] == pwd.getpwuid(os.getuid()).pw_name
        assert stray_entry["command"].startswith("sleep")
        assert device_of(broker, foreign_gpu)["state"] == "busy"
        assert device_of(broker, leased_gpu)["state"] == "leased"
        text = broker.vaccel("status").stdout
        assert f"IN USE WITHOUT LEASE by {stray_entry['user']}: pid {stray.pid} sleep" in text
        # Allocation fails closed: 4 devices exist, only 2 are grantable now.
        r = broker.vaccel("run", "--gpus", "3", "--no-wait", "--", "true")
        assert r.returncode == 75 and "IN USE WITHOUT LEASE" in r.stderr
    finally:
        stray.kill()
        run.terminate()
        run.wait(10)
        stray.wait()
    wait_for(lambda: not leased(broker))
