"""Multi-user tests with real Unix users: identity comes from the kernel, so one user
cannot release, heartbeat or join another's lease, while root and the admin group can
revoke any lease.

Needs root (CI runs as root) to create users with useradd and to run the daemon as root.
The users run the same interpreter as the tests (it must be executable by them: the
Makefile builds the venv from /usr/bin/python3 under /opt) on a world-readable copy of
the sources, since the checkout itself may sit under /root (mode 0700).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LAB_INVENTORY, ROOT, Broker

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="multi-user tests need root to create users"),
]

USERS = ("vaccel-alice", "vaccel-bob", "vaccel-carol")
ADMIN_GROUP = "vaccel-testadm"


def _ensure_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)


def _ensure_group(name: str, members: list[str]) -> None:
    try:
        grp.getgrnam(name)
    except KeyError:
        subprocess.run(["groupadd", name], check=True)
    for member in members:
        subprocess.run(["usermod", "-a", "-G", name, member], check=True)


@pytest.fixture(scope="module")
def staged() -> Iterator[Path]:
    """A world-readable copy of the three packages: vaccel, vaccel_common and brokerd."""
    for user in USERS:
        _ensure_user(user)
    _ensure_group(ADMIN_GROUP, ["vaccel-carol"])
    stage = Path(tempfile.mkdtemp(prefix="vaccel-mu-"))
    os.chmod(stage, 0o755)
    for package in (ROOT / "client" / "vaccel", ROOT / "vaccel_common", ROOT / "brokerd"):
        shutil.copytree(package, stage / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [stage, *stage.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    probe = subprocess.run([sys.executable, "-c", "import grpc, yaml"], user=USERS[0],
                           env={"PYTHONPATH": str(stage)}, capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail(f"{sys.executable} is not usable by other users (build the venv from /usr/bin/python3 "
                    f"outside /root, as the Makefile does): {probe.stderr.strip()}")
    yield stage
    shutil.rmtree(stage, ignore_errors=True)


@pytest.fixture
def root_broker(staged: Path, start_broker) -> Iterator[Broker]:
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-mu-b-"))
    os.chmod(workdir, 0o755)
    config = f'[server]\nadmin_group = "{ADMIN_GROUP}"\n[leases]\nheartbeat_ttl = "5s"\n'
    broker = start_broker(LAB_INVENTORY, config, workdir=workdir)
    yield broker
    broker.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def as_user(broker: Broker, staged: Path, user: str, *args: str, popen: bool = False, **kwargs):
    env = {"PATH": "/usr/bin:/bin", "VACCEL_SOCKET": str(broker.socket), "PYTHONPATH": str(staged),
           "HOME": "/", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vaccel.cli", *args]
    if popen:
        return subprocess.Popen(cmd, user=user, env=env, cwd="/", stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kwargs)
    return subprocess.run(cmd, user=user, env=env, cwd="/", capture_output=True, text=True, timeout=60,
                          **kwargs)


def status(broker: Broker) -> dict:
    r = broker.vaccel("status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_for(predicate, timeout: float = 60.0):
    """Until `predicate` holds; the timeout only turns a hang into a failure (each status
    is a CLI start, seconds on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def alice_holds_a_gpu(broker: Broker, staged: Path) -> tuple[subprocess.Popen, str]:
    holder = as_user(broker, staged, "vaccel-alice", "run", "--", "sh", "-c", "echo $VACCEL_LEASE_ID; sleep 60",
                     popen=True)
    lease_id = holder.stdout.readline().strip()
    assert lease_id.startswith("l-"), holder.stderr.read() if holder.poll() is not None else lease_id
    return holder, lease_id


def test_holder_identity_comes_from_the_kernel(root_broker: Broker, staged: Path):
    holder, lease_id = alice_holds_a_gpu(root_broker, staged)
    try:
        device = next(d for d in status(root_broker)["devices"] if d["lease_id"] == lease_id)
        assert device["holder"]["user"] == "vaccel-alice"
        assert device["holder"]["uid"] == pwd.getpwnam("vaccel-alice").pw_uid
        assert device["holder"]["pid"] == holder.pid
    finally:
        holder.terminate()
        holder.wait(10)


def test_another_user_cannot_release_heartbeat_or_join(root_broker: Broker, staged: Path):
    holder, lease_id = alice_holds_a_gpu(root_broker, staged)
    try:
        r = as_user(root_broker, staged, "vaccel-bob", "release", lease_id)
        assert r.returncode == 1 and "belongs to vaccel-alice" in r.stderr, r.stderr
        r = as_user(root_broker, staged, "vaccel-bob", "leases", "--all")
        assert r.returncode == 1 and "admin" in r.stderr
        # Bob copies Alice's lease id into his environment: joining is refused by uid.
        env = {"PATH": "/usr/bin:/bin", "VACCEL_SOCKET": str(root_broker.socket), "PYTHONPATH": str(staged),
               "VACCEL_LEASE_ID": lease_id, "HOME": "/"}
        code = "import vaccel\nwith vaccel.lease(): pass"
        r = subprocess.run([sys.executable, "-c", code], user="vaccel-bob", env=env, cwd="/", capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0 and "only its holder" in r.stderr
        from vaccel.session.connection import BrokerConnection  # noqa: F401 - imported to prove the module is importable

        hb = ("import grpc\nfrom vaccel.session.connection import BrokerConnection\n"
              "from vaccel_common.v1 import broker_pb2 as pb\n"
              f"c = BrokerConnection()\ntry:\n    c.call('Heartbeat', pb.LeaseRef(lease_id='{lease_id}'))\n"
              "except grpc.RpcError as e:\n    print(e.code().name)\n")
        env.pop("VACCEL_LEASE_ID")
        r = subprocess.run([sys.executable, "-c", hb], user="vaccel-bob", env=env, cwd="/", capture_output=True,
                           text=True, timeout=60)
        assert r.stdout.strip() == "PERMISSION_DENIED", r.stderr
        assert any(d["lease_id"] == lease_id for d in status(root_broker)["devices"]), "alice still holds it"
        # Alice herself can list her leases.
        r = as_user(root_broker, staged, "vaccel-alice", "leases", "--json")
        assert [lease["id"] for lease in json.loads(r.stdout)["leases"]] == [lease_id]
    finally:
        holder.terminate()
        holder.wait(10)


def test_admin_group_member_can_revoke_and_the_holder_is_stopped(root_broker: Broker, staged: Path):
    holder, lease_id = alice_holds_a_gpu(root_broker, staged)
    r = as_user(root_broker, staged, "vaccel-carol", "leases", "--all", "--json")
    assert r.returncode == 0 and lease_id in r.stdout
    r = as_user(root_broker, staged, "vaccel-carol", "release", lease_id, "--reason", "node maintenance")
    assert r.returncode == 0, r.stderr
    assert "revoked" in r.stdout
    # `vaccel run` of alice hears of it at its next heartbeat and stops the command.
    assert holder.wait(30) == 128 + signal.SIGTERM
    assert "node maintenance" in holder.stderr.read()


def test_root_sees_and_releases_everything(root_broker: Broker, staged: Path):
    holder, lease_id = alice_holds_a_gpu(root_broker, staged)
    bob = as_user(root_broker, staged, "vaccel-bob", "run", "--gpus", "3", "--", "sleep", "60", popen=True)
    try:
        wait_for(lambda: sum(d["state"] == "leased" for d in status(root_broker)["devices"]) == 4)
        users = {d["holder"]["user"] for d in status(root_broker)["devices"] if d["holder"]}
        assert users == {"vaccel-alice", "vaccel-bob"}
        r = root_broker.vaccel("leases", "--all", "--json")
        assert {lease["holder"]["user"] for lease in json.loads(r.stdout)["leases"]} == users
        r = root_broker.vaccel("release", lease_id)
        assert r.returncode == 0 and "revoked" in r.stdout
    finally:
        for p in (holder, bob):
            p.terminate()
            p.wait(10)
