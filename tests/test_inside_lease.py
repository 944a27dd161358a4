"""A `vaccel run` inside a lease (issue 33, item 1): inside a reservation's shell, the habitual
`vaccel run -- CMD` joins the reserved lease (as `lease()` does) instead of taking another
GPU or queueing behind one's own limit; asking for more than the lease holds is refused at
once. Against a real daemon; the lease is entered with `vaccel shell -c`, as a student does."""

from __future__ import annotations

import json
import sys
import time

import pytest
from vaccel.session.inside import part_asked
from vaccel.session.lease import LeaseError

from tests.conftest import Broker
from tests.test_broker_integration import status
from vaccel_common.v1 import broker_pb2 as pb

VACCEL = f"{sys.executable} -m vaccel.cli"


def reserve(broker: Broker, *args: str) -> dict:
    r = broker.vaccel("reserve", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def in_shell(broker: Broker, lease_id: str, command: str):
    """`vaccel shell LEASE -c COMMAND`, the way into a reservation the README shows."""
    return broker.vaccel("shell", lease_id, "-c", command, env={**broker.env, "SHELL": "/bin/sh"})


def test_a_run_inside_a_reservation_joins_it_instead_of_taking_another_gpu(broker: Broker):
    held = reserve(broker, "--gpus", "2", "--time", "10m")
    uuids = ",".join(d["uuid"] for d in held["devices"])
    r = in_shell(broker, held["lease_id"], f"{VACCEL} run --no-wait -- sh -c 'echo $CUDA_VISIBLE_DEVICES; "
                                           f"{VACCEL} leases --json'")
    assert r.returncode == 0, r.stderr
    seen, listed = r.stdout.split("\n", 1)
    assert seen == uuids  # the reserved devices, all of them: nothing more was asked for
    assert [lease["id"] for lease in json.loads(listed)["leases"]] == [held["lease_id"]]  # no second lease
    assert f"lease {held['lease_id']} (joined: this runs inside it)" in r.stderr
    # ... and after it, the reservation is still held (a join gives nothing back).
    assert sum(d["lease_id"] == held["lease_id"] for d in status(broker)["devices"]) == 2


def test_a_run_inside_asking_for_part_of_the_lease_gets_that_part_by_index(broker: Broker):
    held = reserve(broker, "--gpus", "2", "--time", "10m")
    low, high = sorted(held["devices"], key=lambda d: d["index"])
    show = "sh -c 'echo $CUDA_VISIBLE_DEVICES'"
    r = in_shell(broker, held["lease_id"], f"{VACCEL} run --gpus 1 -- {show} && "
                                           f"{VACCEL} run --device GPU{high['index']} -- {show}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [low["uuid"], high["uuid"]]


@pytest.mark.parametrize(("asked", "said"), [
    (["--gpus", "3"], "--gpus 3 asks for more"),
    (["--time", "2h"], "--time 2h00m is longer than it lasts (it ends in 9m"),
    (["--min-memory", "100GiB"], "--min-memory 100 GiB is more than gpu0 has (80 GiB)"),
    (["--device", "gpu2"], "--device gpu2 is not in it"),
])
def test_a_run_inside_asking_for_more_than_the_lease_is_refused_at_once(broker: Broker, asked: list[str],
                                                                          said: str):
    held = reserve(broker, "--device", "gpu0", "--device", "gpu1", "--time", "10m")
    r = in_shell(broker, held["lease_id"], f"{VACCEL} run {' '.join(asked)} -- true")
    assert r.returncode == 1, r.stderr
    assert f"this runs inside lease {held['lease_id']} (VACCEL_LEASE_ID), which holds gpu0, gpu1: {said}" in r.stderr
    assert "env -u VACCEL_LEASE_ID vaccel run" in r.stderr  # the way to ask outside it
    assert r.stderr.count("\n") == 1, r.stderr  # one line
    assert not status(broker)["queue"], "nothing was queued"  # said at once, not after a wait in the queue


def test_a_run_in_a_shell_whose_lease_has_ended_says_so_and_the_way_out(broker: Broker):
    held = reserve(broker, "--time", "10m")
    assert broker.vaccel("release", held["lease_id"]).returncode == 0
    r = broker.vaccel("run", "--", "true", env={**broker.env, "VACCEL_LEASE_ID": held["lease_id"]})
    assert r.returncode == 1
    assert r.stderr.startswith(f"vaccel: lease {held['lease_id']} has ended: released by its holder; this process "
                               "runs inside it (VACCEL_LEASE_ID): leave that shell"), r.stderr
    # --lease names only what the user typed: no VACCEL_LEASE_ID they never set.
    r = broker.vaccel("run", "--lease", held["lease_id"], "--", "true")
    assert r.returncode == 1 and "VACCEL_LEASE_ID" not in r.stderr, r.stderr
    assert r.stderr == f"vaccel: lease {held['lease_id']} has ended: released by its holder\n"


def _lease(*devices: tuple[int, int], expires_in: float = 0.0) -> pb.Lease:
    msg = pb.Lease(id="l-1", expires_at=time.time() + expires_in if expires_in else 0.0)
    for index, memory in devices:
        msg.devices.add(index=index, uuid=f"GPU-{index}", memory_mib=memory)
    return msg


def test_the_part_asked_is_the_lowest_devices_the_named_ones_or_the_whole_lease():
    held = _lease((3, 1024), (1, 2048), (2, 4096))
    assert [d.index for d in part_asked(held, gpus=1, whole=True).devices] == [1, 2, 3]
    assert [d.index for d in part_asked(held, gpus=2, whole=False).devices] == [1, 2]
    assert [d.index for d in part_asked(held, gpus=2, whole=False, devices=("gpu3", "GPU-1")).devices] == [1, 3]
    assert [d.index for d in part_asked(held, gpus=1, whole=False, min_memory_mib=2048).devices] == [1]
    with pytest.raises(LeaseError, match=r"--min-memory 2 GiB is more than gpu3 has \(1 GiB\)"):
        part_asked(held, gpus=1, whole=False, devices=("gpu3",), min_memory_mib=2048)
    assert part_asked(_lease((0, 1024), expires_in=3600), gpus=1, whole=False, time_limit_s=600).devices
    with pytest.raises(LeaseError, match="--time 2h00m is longer than it lasts"):
        part_asked(_lease((0, 1024), expires_in=3600), gpus=1, whole=False, time_limit_s=7200)
