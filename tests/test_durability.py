"""Durability: kill -9 of the daemon (idle and under load) and a restart keep every
invariant; a state file it cannot trust makes it refuse to start."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import LAB_INVENTORY, Broker
from tests.test_broker_integration import drained_by_me, leased, status, wait_for

CONFIG = """
[leases]
heartbeat_ttl = "5s"
"""

HOLDER = """
import sys, time, vaccel
lost = []
with vaccel.lease(gpus=int(sys.argv[1]), on_lost=lambda l, why: lost.append(why)) as l:
    print(l.id, flush=True)
    sys.stdin.readline()          # hold until the test says so
    print("lost" if lost else "kept", lost, flush=True)
"""


def hold(broker: Broker, gpus: int = 1) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([broker.python, "-c", HOLDER, str(gpus)], env=broker.env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lease_id = p.stdout.readline().strip()
    assert lease_id.startswith("l-"), p.stderr.read()
    return p, lease_id


def finish(p: subprocess.Popen) -> str:
    out, _ = p.communicate("\n", timeout=30)
    return out.strip()


def test_kill9_and_restart_restores_leases_and_holders_do_not_notice(start_broker):
    broker = start_broker(config=CONFIG)
    holders = [hold(broker, gpus) for gpus in (1, 2)]
    before = {d["uuid"]: d["lease_id"] for d in status(broker)["devices"]}
    broker.kill9()
    time.sleep(1.0)  # holders' heartbeats hit a dead socket meanwhile
    broker.start()
    after = {d["uuid"]: d["lease_id"] for d in status(broker)["devices"]}
    assert after == before, "every live lease is back on the same devices"
    time.sleep(6)  # longer than the TTL: the holders must have kept heartbeating
    assert {d["lease_id"] for d in status(broker)["devices"] if d["lease_id"]} == {lid for _, lid in holders}
    # The one free device can be leased, and only it.
    free = next(u for u, lid in before.items() if lid is None)
    r = broker.vaccel("run", "--no-wait", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == free
    last, last_id = hold(broker)
    assert {d["uuid"]: d["lease_id"] for d in status(broker)["devices"]} == {**before, free: last_id}
    refused = broker.vaccel("run", "--no-wait", "--", "true")
    assert refused.returncode != 0, "a fifth lease was granted with all four devices held"
    assert "no free device" in refused.stderr, refused.stderr
    assert sorted(leased(broker)) == sorted(before)
    assert finish(last).startswith("kept")
    for p, _ in holders:
        assert finish(p).startswith("kept"), "a holder noticed more than a retry"
    assert leased(broker) == []


def test_holder_that_died_while_the_daemon_was_down_is_reclaimed(start_broker):
    broker = start_broker(config=CONFIG)
    p, lease_id = hold(broker)
    broker.kill9()
    p.kill()
    p.wait()
    broker.start()
    assert leased(broker) == []
    leases = json.loads(broker.vaccel("leases", "--ended", "--json").stdout)["leases"]
    ended = next(lease for lease in leases if lease["id"] == lease_id)
    assert ended["state"] == "holder_exited" and "down" in ended["end_reason"]


LOAD_CLIENT = """
import os, sys, time, vaccel
from vaccel import LeaseError
locks = sys.argv[1]
rounds, violations, done = int(sys.argv[2]), 0, 0
while done < rounds:
    try:
        with vaccel.lease(wait=True, on_queue=None, on_lost=lambda l, why: None) as l:
            mine = []
            for uuid in os.environ["VACCEL_DEVICES"].split(","):
                try:
                    fd = os.open(os.path.join(locks, uuid), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                    os.write(fd, l.id.encode())
                    os.close(fd)
                    mine.append(uuid)
                except FileExistsError:
                    violations += 1
                    other = open(os.path.join(locks, uuid)).read()
                    print(f"violation: {l.id} and {other} on {uuid} at {time.time():.3f}", file=sys.stderr)
            time.sleep(0.01)
            for uuid in mine:
                os.unlink(os.path.join(locks, uuid))
        done += 1
    except LeaseError as exc:
        if exc.code not in ("unavailable", "cancelled"):
            raise
        time.sleep(0.2)   # the broker is restarting
print(violations, done, flush=True)
"""


def test_kill9_under_load_never_grants_a_device_twice(start_broker):
    broker = start_broker(config=CONFIG)
    locks = Path(tempfile.mkdtemp(prefix="vaccel-locks-"))
    clients = [subprocess.Popen([broker.python, "-c", LOAD_CLIENT, str(locks), "40"], env=broker.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    time.sleep(2)
    for _ in range(2):
        broker.kill9()
        db = sqlite3.connect(broker.state_dir / "leases.db")
        active = db.execute("SELECT COUNT(*) FROM leases WHERE state='active'").fetchone()[0]
        held = db.execute("SELECT COUNT(*) FROM holdings").fetchone()[0]
        db.close()
        assert held <= 4 and active <= 4
        broker.start()
        time.sleep(2)
    results, errors = [], []
    for c in clients:
        out, err = c.communicate(timeout=240)
        assert c.returncode == 0, err
        results.append(tuple(map(int, out.split())))
        errors.append(err)
    assert sum(v for v, _ in results) == 0, f"a device was held by two leases at once: {errors}"
    assert all(done == 40 for _, done in results)
    wait_for(lambda: not leased(broker), timeout=60)


def _start_fails(broker: Broker) -> str:
    r = subprocess.run(broker.command(), env=broker.env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    return r.stderr


def test_untrustworthy_state_refuses_to_start(start_broker):
    broker = start_broker(config=CONFIG)
    broker.stop()
    db = broker.state_dir / "leases.db"
    # Holdings that contradict the leases: the daemon must not guess which is right.
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA foreign_keys=OFF")
    conn.execute("INSERT INTO holdings VALUES ('GPU-x', 'l-ghost')")
    conn.commit()
    conn.close()
    err = _start_fails(broker)
    assert "refusing to start" in err and "do not match" in err and str(db) in err
    # Not a database at all.
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    db.write_bytes(b"this is not sqlite" * 100)
    err = _start_fails(broker)
    assert "refusing to start" in err and "not a usable SQLite database" in err


def test_second_daemon_on_the_same_state_is_refused(broker: Broker):
    other = subprocess.run([sys.executable, "-m", "brokerd", "--state-dir", str(broker.state_dir),
                            "--socket", str(broker.workdir / "other.sock"), "--inventory", str(LAB_INVENTORY)],
                           capture_output=True, text=True, timeout=30)
    assert other.returncode == 1 and "already uses the state directory" in other.stderr
    same_socket = subprocess.run([sys.executable, "-m", "brokerd", "--state-dir",
                                  str(broker.workdir / "other-state"), "--socket", str(broker.socket),
                                  "--inventory", str(LAB_INVENTORY)], capture_output=True, text=True, timeout=30)
    assert same_socket.returncode == 1 and "already listening" in same_socket.stderr


def test_sigterm_exits_cleanly_and_leases_survive(start_broker):
    broker = start_broker(config=CONFIG)
    p, lease_id = hold(broker)
    assert broker.stop() == 0
    assert not broker.socket.exists()
    broker.start()
    assert [d["lease_id"] for d in status(broker)["devices"] if d["lease_id"]] == [lease_id]
    assert finish(p).startswith("kept")


def test_bad_inventory_is_a_clear_startup_error(tmp_path: Path):
    bad = tmp_path / "inv.yaml"
    bad.write_text(textwrap.dedent("""
        devices:
          - vendor: nvidia
            name: x
            uuid: GPU-1
            memory_mib: -1
    """))
    r = subprocess.run([sys.executable, "-m", "brokerd", "--inventory", str(bad), "--socket",
                        str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "st")],
                       capture_output=True, text=True, timeout=30, env={**os.environ})
    assert r.returncode == 1 and "memory_mib must be positive" in r.stderr and "Traceback" not in r.stderr


def test_drained_devices_stay_drained_across_restart(start_broker):
    broker = start_broker(config=CONFIG)
    assert broker.vaccel("drain", "gpu1", "--reason", "replacing fan").returncode == 0
    broker.kill9()
    broker.start()
    device = status(broker)["devices"][1]
    assert device["state"] == "drained" and re.fullmatch(drained_by_me("replacing fan"), device["drain_reason"])


def test_the_durability_setting_is_read_and_a_wrong_value_refused(tmp_path: Path):
    from brokerd.config.loader import ConfigError, load_config

    path = tmp_path / "brokerd.toml"
    path.write_text("")
    assert load_config(path).durability == "crash"
    path.write_text('[server]\ndurability = "power"\n')
    assert load_config(path).durability == "power"
    path.write_text('[server]\ndurability = "sometimes"\n')
    with pytest.raises(ConfigError, match=r"server.durability must be 'crash' .* or 'power'"):
        load_config(path)
