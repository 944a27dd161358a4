"""A burst of waiting requests, more than the daemon's event loop takes in at once, is
queued whole.

gRPC's server keeps the calls that have arrived but that the application has not taken
yet, and by default cancels new ones at random past 1,000 of them and every one past
3,000. A lab's users starting their jobs at once (bench.scale: 40 users queueing 50
requests each) had some of their requests end CANCELLED before the broker saw them:
waiters lost without a word (issue 46).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LAB_INVENTORY, Broker
from tests.test_multiuser import staged  # noqa: F401 - a fixture, used by name

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="other users' requests need root (setuid to bare uids)"),
]

USERS = 4
PER_USER = 1000  # the daemon's own cap is 1,024 waiting per user; the policy below allows them
FIRST_UID = 6_200_000  # bare uids, no accounts (bench.scale does the same)

# One user: mint a token, open a connection per 50 calls, say "ready"; on "go" open PER_USER
# Acquire streams at once and read each one's first update; print what came back.
CLIENT = """
import asyncio, json, sys
import grpc
from vaccel.session.connection import BrokerConnection
from vaccel_common.v1 import broker_pb2 as pb, broker_pb2_grpc

path, count = sys.argv[1], int(sys.argv[2])
conn = BrokerConnection(path)
conn.call("Status", pb.StatusRequest(), retry_unavailable_s=30)
metadata = conn.metadata()
conn.close()

async def main():
    # Each its own connection: channels to one target otherwise share one, 256 streams at most.
    channels = [grpc.aio.insecure_channel(f"unix:{path}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(count // 50)]
    for channel in channels:
        await channel.channel_ready()
    stubs = [broker_pb2_grpc.BrokerStub(channel) for channel in channels]
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    calls = [stubs[i % len(stubs)].Acquire(pb.AcquireRequest(gpus=1, wait_forever=True, command="burst"),
                                           metadata=metadata) for i in range(count)]

    async def first(call):
        update = await call.read()
        return "granted" if update.HasField("granted") else "queued"

    results = await asyncio.gather(*(first(call) for call in calls), return_exceptions=True)
    failed = [r for r in results if r not in ("granted", "queued")]
    codes = sorted({f"{r.code().name}: {r.details()}" if isinstance(r, grpc.RpcError) else repr(r) for r in failed})
    print(json.dumps({"served": len(results) - len(failed), "failed": len(failed), "codes": codes[:3]}), flush=True)
    for call in calls:
        call.cancel()

asyncio.run(main())
"""


def test_a_burst_of_waiting_requests_beyond_grpcs_default_backlog_is_queued_whole(start_broker, staged: Path):  # noqa: F811
    config = f'[leases]\nheartbeat_ttl = "1h"\n[policy.default]\nmax_waiting = {PER_USER + 24}\n'
    broker: Broker = start_broker(LAB_INVENTORY, config)
    for folder in (broker.socket.parent, broker.socket.parent.parent):
        os.chmod(folder, 0o755)  # the users reach the socket
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(staged), "HOME": "/", "PYTHONUNBUFFERED": "1"}
    users = [subprocess.Popen([sys.executable, "-c", CLIENT, str(broker.socket), str(PER_USER)], user=uid,
                              group=uid, extra_groups=[], env=env, cwd="/", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for uid in range(FIRST_UID, FIRST_UID + USERS)]
    try:
        for user in users:
            line = user.stdout.readline()  # type: ignore[union-attr]
            assert line == "ready\n", (line, user.stderr.read() if user.poll() is not None else "")  # type: ignore[union-attr]
        for user in users:  # all at once: the burst
            user.stdin.write("go\n")  # type: ignore[union-attr]
            user.stdin.flush()  # type: ignore[union-attr]
        outcomes = []
        for user in users:
            out, err = user.communicate(timeout=600)  # only turns a hang into a failure
            assert user.returncode == 0, err[-2000:]
            outcomes.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for user in users:
            if user.poll() is None:
                user.kill()
                user.wait()
    assert [o["failed"] for o in outcomes] == [0] * USERS, outcomes
    assert sum(o["served"] for o in outcomes) == USERS * PER_USER
