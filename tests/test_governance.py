"""Governing a shared server, against a real daemon with real Unix users: limits by
group, the fair order, time limits with their warning and signals, an admin's revoke
with grace, idle reclaim, a reload of the policy under load, and reservations.

Needs root (CI runs as root) to create the users, like tests/test_multiuser.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LAB_INVENTORY, Broker
from tests.test_multiuser import ADMIN_GROUP, _ensure_group, as_user, staged, status, wait_for  # noqa: F401

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="multi-user tests need root to create users"),
]

STUDENTS = "vaccel-students"
# Logs each signal it gets (USR1 = checkpoint now, TERM = the end), one per line.
TRAP = """
import signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
def on(sig, _):
    log.write(signal.Signals(sig).name + "\\n")
    if sig == signal.SIGTERM:
        sys.exit(0)
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGTERM, on)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def governed(staged: Path, start_broker) -> Iterator:  # noqa: F811 - the fixture imported above
    """A factory: governed(policy_toml) -> a root daemon with that [policy], the admin group
    and a shared world-writable work dir for the users' files."""
    _ensure_group(STUDENTS, ["vaccel-alice", "vaccel-bob"])
    made: list[Path] = []

    def start(policy: str = "", extra: str = "") -> Broker:
        workdir = Path(tempfile.mkdtemp(prefix="vaccel-gov-"))
        made.append(workdir)
        os.chmod(workdir, 0o755)
        shared = workdir / "shared"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        (shared / "trap.py").write_text(TRAP)
        os.chmod(shared / "trap.py", 0o644)
        config = (f'[server]\nadmin_group = "{ADMIN_GROUP}"\n[leases]\nheartbeat_ttl = "4s"\n'
                  f'[probe]\nrefresh_interval = "0.5s"\n{extra}\n{policy}')
        return start_broker(LAB_INVENTORY, config, workdir=workdir)

    yield start
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def signals_logged(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def holding(broker: Broker, staged: Path, user: str, *run_args: str) -> tuple[subprocess.Popen, str]:  # noqa: F811
    """`vaccel run RUN_ARGS -- sh -c 'echo $VACCEL_LEASE_ID; sleep 60'` as `user`; (process, lease id)."""
    proc = as_user(broker, staged, user, "run", *run_args, "--", "sh", "-c", "echo $VACCEL_LEASE_ID; exec sleep 60",
                   popen=True)
    lease_id = proc.stdout.readline().strip()
    assert lease_id.startswith("l-"), proc.stderr.read() if proc.poll() is not None else lease_id
    return proc, lease_id


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(15)


def queue_line(proc: subprocess.Popen, needle: str) -> str:
    """Read the waiter's stderr until a line contains `needle`."""
    for line in proc.stderr:
        if needle in line:
            return line.strip()
    raise AssertionError(f"no line with {needle!r}")


STUDENT_LIMIT = f'[policy.group.{STUDENTS}]\nmax_devices = 1\n'


def test_a_group_limit_refuses_what_never_fits_and_holds_back_only_its_own_user(governed, staged):  # noqa: F811
    broker = governed(STUDENT_LIMIT)
    r = as_user(broker, staged, "vaccel-alice", "run", "--gpus", "2", "--", "true")
    assert r.returncode == 1
    assert f"limit max_devices=1 for group {STUDENTS}: a request for 2 devices can never start here" in r.stderr
    first, _ = holding(broker, staged, "vaccel-alice")
    second = as_user(broker, staged, "vaccel-alice", "run", "--", "true", popen=True)
    try:
        line = queue_line(second, "waiting for 1 GPU")
        assert f"(limit max_devices=1 for group {STUDENTS}: you hold 1 (gpu" in line, line
        # Bob, also a student, asks after her and starts at once: her limit holds up nobody else.
        r = as_user(broker, staged, "vaccel-bob", "run", "--", "true")
        assert r.returncode == 0, r.stderr
        shown = status(broker)
        assert shown["queue"][0]["reason"].startswith(f"limit max_devices=1 for group {STUDENTS}")
        alice = next(u for u in shown["usage"] if u["user"] == "vaccel-alice")
        assert (alice["policy"], alice["devices_held"], alice["max_devices"], alice["waiting"]) == (
            f"group {STUDENTS}", 1, 1, 1)
        text = broker.vaccel("status").stdout
        assert f"limit max_devices=1 for group {STUDENTS}" in text
        # Once she gives her first lease back, the second starts.
        stop(first)
        assert second.wait(30) == 0
    finally:
        stop(first, second)


def test_the_user_holding_nothing_is_served_before_the_one_holding_much(governed, staged):  # noqa: F811
    broker = governed()
    shared = broker.workdir / "shared"
    carol, _ = holding(broker, staged, "vaccel-carol", "--device", "gpu0")
    much, _ = holding(broker, staged, "vaccel-alice", "--device", "gpu1", "--device", "gpu2")

    def started(user: str) -> subprocess.Popen:  # writes when its command started, in ns
        return as_user(broker, staged, f"vaccel-{user}", "run", "--device", "gpu0", "--", "sh", "-c",
                       f"date +%s%N > {shared / user}; sleep 1", popen=True)

    alice = started("alice")
    bob = None
    try:
        queue_line(alice, "waiting for 1 GPU")
        bob = started("bob")
        line = queue_line(bob, "waiting for 1 GPU")
        assert "position 1 of 2" in line, line  # ahead of alice, who arrived first but holds two devices
        stop(carol)
        assert bob.wait(30) == 0 and alice.wait(30) == 0
        assert int((shared / "bob").read_text()) < int((shared / "alice").read_text())
    finally:
        stop(carol, much, alice, *([bob] if bob else []))


def test_a_time_limit_warns_then_ends_with_the_signals_in_order(governed, staged):  # noqa: F811
    broker = governed()
    log = broker.workdir / "shared" / "signals"
    r = as_user(broker, staged, "vaccel-alice", "run", "--time", "3s", "--", "python3",
                str(broker.workdir / "shared" / "trap.py"), str(log))
    assert signals_logged(log) == ["SIGUSR1", "SIGTERM"], r.stderr
    assert "ends in" in r.stderr and "time limit of 3s" in r.stderr and "sent SIGUSR1 to the command" in r.stderr
    ended = json.loads(broker.vaccel("leases", "--all", "--ended", "--json").stdout)["leases"]
    assert [(x["state"], x["end_reason"]) for x in ended] == [("time_limit", "reached its time limit of 3s")]


def test_an_admin_revokes_with_grace_and_the_holder_hears_the_reason(governed, staged):  # noqa: F811
    broker = governed()
    log = broker.workdir / "shared" / "signals"
    job = as_user(broker, staged, "vaccel-alice", "run", "--", "python3", str(broker.workdir / "shared" / "trap.py"),
                  str(log), popen=True)
    try:
        assert job.stdout.readline().strip() == "ready"
        lease_id = status(broker)["devices"][0]["lease_id"] or next(
            d["lease_id"] for d in status(broker)["devices"] if d["lease_id"])
        r = as_user(broker, staged, "vaccel-carol", "release", lease_id, "--grace", "3s", "--reason",
                    "driver update")
        assert r.returncode == 0 and "its holder has been told: revoked by vaccel-carol: driver update" in r.stdout, \
            r.stdout + r.stderr
        warned = queue_line(job, "revoked by vaccel-carol: driver update")
        assert "sent SIGUSR1" in warned, warned
        job.wait(30)
        assert signals_logged(log) == ["SIGUSR1", "SIGTERM"]
        ended = json.loads(broker.vaccel("leases", "--all", "--ended", "--json").stdout)["leases"]
        assert [x["state"] for x in ended if x["id"] == lease_id] == ["revoked"]
        assert "driver update" in next(x["end_reason"] for x in ended if x["id"] == lease_id)
    finally:
        stop(job)


IDLE = '[policy]\nidle_reclaim = "2s"\nidle_warning = "2s"\n'
BUSY_LOOP = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"


def test_idle_reclaim_takes_back_a_sleeping_lease_but_never_a_computing_one(governed, staged):  # noqa: F811
    broker = governed(IDLE)
    sleeper, sleeping = holding(broker, staged, "vaccel-alice", "--device", "gpu0")
    computer = as_user(broker, staged, "vaccel-bob", "run", "--device", "gpu1", "--", "python3", "-c", BUSY_LOOP,
                       popen=True)
    waiter = None
    try:
        wait_for(lambda: sum(d["state"] == "leased" for d in status(broker)["devices"]) == 2)
        computing = next(d["lease_id"] for d in status(broker)["devices"] if d["index"] == 1)
        # Nobody waits: an idle lease is left alone.
        time.sleep(3)
        assert all(d["lease_id"] in (sleeping, computing) for d in status(broker)["devices"] if d["lease_id"])
        waiter = as_user(broker, staged, "vaccel-carol", "run", "--device", "gpu0", "--device", "gpu1", "--gpus",
                         "1", "--", "sh", "-c", "echo $VACCEL_LEASE_ID", popen=True)
        warned = queue_line(sleeper, "while others wait: reclaimed at")
        assert warned.startswith(f"vaccel: lease {sleeping} ends in"), warned
        # sleep has no handler for the warning signal: it is not killed by it.
        assert warned.endswith("the command does not handle SIGUSR1, so it was not sent"), warned
        assert waiter.wait(30) == 0
        ended = json.loads(broker.vaccel("leases", "--all", "--ended", "--json").stdout)["leases"]
        assert [x["state"] for x in ended if x["id"] == sleeping] == ["idle"]
        active = json.loads(broker.vaccel("leases", "--all", "--json").stdout)["leases"]
        assert computing in [x["id"] for x in active] and not next(
            x for x in active if x["id"] == computing)["notice"]
    finally:
        stop(sleeper, computer, *([waiter] if waiter else []))


def test_a_reload_changes_limits_under_leases_and_waiters_and_a_bad_one_changes_nothing(governed, staged):  # noqa: F811
    broker = governed(STUDENT_LIMIT)
    first, lease_id = holding(broker, staged, "vaccel-alice")
    second = as_user(broker, staged, "vaccel-alice", "run", "--", "sh", "-c", "echo $VACCEL_LEASE_ID", popen=True)
    try:
        queue_line(second, "limit max_devices=1")
        text = broker.config.read_text()
        broker.config.write_text(text.replace("max_devices = 1", "max_devices = 1\nmax_gpus = 3"))
        broker.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "max_gpus" in broker.log.read_text())  # the reload was read (and refused)...
        assert status(broker)["queue"], "a refused reload must keep the running policy"  # ...and changed nothing
        broker.config.write_text(text.replace("max_devices = 1", "max_devices = 2"))
        broker.proc.send_signal(signal.SIGHUP)
        assert second.wait(30) == 0, "the waiter starts once the limit allows it"
        assert any(d["lease_id"] == lease_id for d in status(broker)["devices"]), "the lease held on"
    finally:
        stop(first, second)


def test_a_reservation_is_the_users_across_restarts_and_ends_at_its_limit(governed, staged):  # noqa: F811
    broker = governed()
    r = as_user(broker, staged, "vaccel-alice", "reserve", "--gpus", "1", "--time", "1h", "--json")
    assert r.returncode == 0, r.stderr
    booked = json.loads(r.stdout)
    assert set(booked) >= {"lease_id", "devices", "env", "expires_at"}
    lease_id, uuid = booked["lease_id"], booked["devices"][0]["uuid"]
    assert 3590 < booked["expires_at"] - time.time() <= 3600
    r = as_user(broker, staged, "vaccel-alice", "run", "--lease", lease_id, "--", "sh", "-c",
                "echo $VACCEL_LEASE_ID $CUDA_VISIBLE_DEVICES")
    assert r.returncode == 0 and r.stdout.split() == [lease_id, booked["env"]["CUDA_VISIBLE_DEVICES"]], r.stderr
    for attempt in (("run", "--lease", lease_id, "--", "true"), ("release", lease_id)):
        r = as_user(broker, staged, "vaccel-bob", *attempt)
        assert r.returncode != 0 and "vaccel-alice" in r.stderr, r.stderr
    broker.kill9()
    broker.start()
    device = next(d for d in status(broker)["devices"] if d["uuid"] == uuid)
    assert device["lease_id"] == lease_id and device["holder"]["user"] == "vaccel-alice"
    r = as_user(broker, staged, "vaccel-alice", "release", lease_id)
    assert r.returncode == 0, r.stderr
    # A short one ends at its limit, and a command running in it hears first.
    booked = json.loads(as_user(broker, staged, "vaccel-alice", "reserve", "--time", "3s", "--json").stdout)
    log = broker.workdir / "shared" / "signals"
    r = as_user(broker, staged, "vaccel-alice", "run", "--lease", booked["lease_id"], "--", "python3",
                str(broker.workdir / "shared" / "trap.py"), str(log))
    assert signals_logged(log) == ["SIGUSR1", "SIGTERM"], r.stderr
    ended = json.loads(broker.vaccel("leases", "--all", "--ended", "--json").stdout)["leases"]
    assert [x["state"] for x in ended if x["id"] == booked["lease_id"]] == ["time_limit"]


LENDING = '[policy]\nlend_idle = true\nlend_notice = "3s"\n' + STUDENT_LIMIT


def test_lend_idle_lends_a_capped_student_an_idle_gpu_until_a_request_within_limits_needs_it(governed, staged):  # noqa: F811
    broker = governed(LENDING)
    own, own_id = holding(broker, staged, "vaccel-alice")
    # Over her limit of 1, with three GPUs idle and nobody else asking: she borrows one.
    lent, lent_id = holding(broker, staged, "vaccel-alice")
    carol = None
    try:
        shown = status(broker)
        assert [d["borrowed"] for d in shown["devices"] if d["lease_id"] == lent_id] == [True]
        assert [d["borrowed"] for d in shown["devices"] if d["lease_id"] == own_id] == [False]
        assert "(borrowed)" in broker.vaccel("status").stdout
        leases = json.loads(broker.vaccel("leases", "--all", "--json").stdout)["leases"]
        assert {x["id"]: x["borrowed"] for x in leases} == {own_id: False, lent_id: True}
        # Carol, within her limits, needs three GPUs: two are free, the third is the borrowed one.
        carol = as_user(broker, staged, "vaccel-carol", "run", "--gpus", "3", "--", "true", popen=True)
        told = queue_line(lent, "lent while idle")
        assert "a request within its limits needs gpu" in told, told
        assert carol.wait(60) == 0, carol.stderr.read()
        ended = json.loads(broker.vaccel("leases", "--all", "--ended", "--json").stdout)["leases"]
        mine = next(x for x in ended if x["id"] == lent_id)
        assert (mine["state"], mine["borrowed"]) == ("revoked", True)
        assert mine["end_reason"].startswith("lent while idle"), mine["end_reason"]
        assert own_id in {x["id"] for x in json.loads(broker.vaccel("leases", "--all", "--json").stdout)["leases"]}
    finally:
        stop(own, lent, *([carol] if carol else []))
