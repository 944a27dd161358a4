"""A step of the wall clock (NTP, `date -s`) while leases are held: time limits, heartbeat
TTLs and ages run on the monotonic clock, so a step ends nothing early and keeps nothing
past its limit (brokerd/base/clock.py; docs/durability.md "A wall-clock step"). The daemon's
clock alone is stepped, through VACCEL_TEST_WALL_STEP_FILE (clock.py says why not libfaketime)."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from tests.conftest import LAB_INVENTORY, Broker
from tests.test_broker_integration import leased, status, wait_for

TTL_S = 3.0
CONFIG = f"""
[leases]
heartbeat_ttl = "{TTL_S:g}s"
"""

HOLDER = """
import sys, vaccel
with vaccel.lease(gpus=1, time=sys.argv[1] or None, on_lost=lambda l, why: print("lost", why, flush=True)) as l:
    print(l.id, flush=True)
    sys.stdin.readline()          # hold until the test says so
    print("done", flush=True)
"""


def stepped_broker(tmp: Path) -> tuple[Broker, Path]:
    step = tmp / "wall-step"
    step.write_text("0\n")
    broker = Broker(tmp, LAB_INVENTORY, CONFIG)
    broker.env["VACCEL_TEST_WALL_STEP_FILE"] = str(step)
    return broker.start(), step


def hold(broker: Broker, time_limit: str = "") -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([broker.python, "-c", HOLDER, time_limit], env=broker.env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lease_id = p.stdout.readline().strip()
    assert lease_id.startswith("l-"), p.stderr.read()
    return p, lease_id


def active(broker: Broker, lease_id: str) -> bool:
    return any(d.get("lease_id") == lease_id for d in status(broker)["devices"])


def test_a_wall_clock_step_forward_ends_no_heartbeating_lease_and_shortens_no_time_limit():
    with tempfile.TemporaryDirectory(prefix="vaccel-") as tmp:
        broker, step = stepped_broker(Path(tmp))
        try:
            holder, lease_id = hold(broker)
            limited, limited_id = hold(broker, "1h")
            step.write_text("600\n")  # ten minutes ahead, for the daemon only
            # Give the old behaviour its chance: several TTLs of the real clock go by, in
            # which every heartbeat is 600 s "late" by the wall clock.
            time.sleep(3 * TTL_S)
            assert active(broker, lease_id) and active(broker, limited_id), broker.log.read_text()
            left = [d["time_left_s"] for d in status(broker)["devices"] if d.get("lease_id") == limited_id]
            assert left and left[0] > 3000, left  # its hour is still (nearly) an hour
            for p in (holder, limited):
                out, _ = p.communicate("\n", timeout=30)
                assert out.strip() == "done", out
            assert "the wall clock stepped by +600" in broker.log.read_text()
        finally:
            broker.stop()


def test_a_wall_clock_step_back_keeps_no_lease_past_its_limit():
    with tempfile.TemporaryDirectory(prefix="vaccel-") as tmp:
        broker, step = stepped_broker(Path(tmp))
        try:
            holder, lease_id = hold(broker, "8s")
            step.write_text("-600\n")  # ten minutes back: the limit must not grow by them
            wait_for(lambda: not active(broker, lease_id), timeout=120)
            told = holder.stdout.readline()  # the holder hears of it at its next heartbeat
            assert told.startswith("lost") and "time limit" in told, told
            holder.communicate("\n", timeout=30)
            assert not leased(broker)
        finally:
            broker.stop()


def test_a_restart_after_a_step_restores_the_limits_as_they_run():
    with tempfile.TemporaryDirectory(prefix="vaccel-") as tmp:
        broker, step = stepped_broker(Path(tmp))
        try:
            holder, lease_id = hold(broker, "1h")
            step.write_text("600\n")
            wait_for(lambda: "after the wall-clock step are on disk" in broker.log.read_text(), timeout=60)
            broker.kill9()
            broker.start()  # the wall clock, 10 minutes ahead now, trusted again
            left = [d["time_left_s"] for d in status(broker)["devices"] if d.get("lease_id") == lease_id]
            assert left and left[0] > 3000, left  # not an hour less the step
            out, _ = holder.communicate("\n", timeout=30)
            assert out.strip() == "done", out
        finally:
            broker.stop()
