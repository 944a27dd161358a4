"""Integration tests: the real daemon as a subprocess on a Unix socket, the real CLI and
client library in other processes."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import Broker, alive

A100_1 = "GPU-6f1a0c2e-0000-0000-0000-000000000001"


def status(broker: Broker) -> dict:
    result = broker.vaccel("status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def leased(broker: Broker) -> list[str]:
    return [d["uuid"] for d in status(broker)["devices"] if d["state"] == "leased"]


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.05):
    """Until `predicate` holds; the timeout only turns a hang into a failure (a CLI call
    takes seconds on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def python(broker: Broker, code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([broker.python, "-c", textwrap.dedent(code)], env=broker.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_run_sets_the_lease_environment_and_returns_the_exit_status(broker: Broker):
    result = broker.vaccel("run", "--gpus", "2", "--", "sh", "-c", "env; exit 7")
    assert result.returncode == 7, result.stderr
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    visible = env["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(visible) == 2 and all(v.startswith("GPU-") for v in visible)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["VACCEL_LEASE_ID"].startswith("l-")
    assert env["VACCEL_DEVICES"] == env["CUDA_VISIBLE_DEVICES"]
    assert leased(broker) == [], "the lease must end with the command"


def test_status_json_shape(broker: Broker):
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "sleep", "3600"], env=broker.env,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: leased(broker))
        data = status(broker)
        assert {"devices", "queue"} <= data.keys()
        held = [d for d in data["devices"] if d["state"] == "leased"]
        assert len(held) == 1
        d = held[0]
        for key in ("index", "uuid", "vendor", "name", "memory_mib", "state", "lease_id", "holder"):
            assert key in d
        assert isinstance(d["memory_mib"], int)
        assert d["holder"]["pid"] == holder.pid
        assert d["holder"]["uid"] == os.getuid()
        assert d["holder"]["user"]
        free = [d for d in data["devices"] if d["state"] == "free"]
        assert all(d["holder"] is None and d["lease_id"] is None for d in free)
    finally:
        holder.terminate()
        holder.wait(10)


def test_queue_waits_in_fifo_order_and_shows_position(broker: Broker):
    first = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--gpus", "4", "--", "sleep", "2"],
                             env=broker.env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(leased(broker)) == 4)
    second = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--gpus", "1", "--", "true"],
                              env=broker.env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: status(broker)["queue"])
    queue = status(broker)["queue"]
    assert queue[0]["position"] == 1 and queue[0]["gpus"] == 1
    assert second.wait(20) == 0
    assert first.wait(20) == 0
    err = second.stderr.read()
    assert "waiting for 1 GPU: position 1 of 1" in err
    assert "since" in err, "the queue message says who holds what"


def test_no_wait_and_wait_timeout_and_unsatisfiable(broker: Broker):
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--gpus", "4", "--", "sleep", "3600"],
                              env=broker.env, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(leased(broker)) == 4)
        r = broker.vaccel("run", "--no-wait", "--", "true")
        assert r.returncode == 75 and "no free device" in r.stderr
        r = broker.vaccel("run", "--wait", "1s", "--", "true")
        assert r.returncode == 75 and "gave up" in r.stderr
        # It gave up by itself: the devices it waited for are still held (no clock needed).
        assert holder.poll() is None and len(leased(broker)) == 4
        assert status(broker)["queue"] == [], "a request that gave up leaves the queue"
        r = broker.vaccel("run", "--gpus", "5", "--", "true")
        assert r.returncode == 1 and "only 4" in r.stderr
        r = broker.vaccel("run", "--min-memory", "200GiB", "--", "true")
        assert r.returncode == 1 and "memory" in r.stderr.lower()
        assert "Traceback" not in r.stderr
    finally:
        holder.terminate()
        holder.wait(10)


def test_sigkill_of_vaccel_run_kills_the_command_and_frees_the_device(start_broker, tmp_path: Path):
    # A heartbeat TTL far past the wait: the device freed at all was freed by noticing the
    # holder's death, not by its missed heartbeats (the verdict needs no clock; the figure
    # is printed).
    broker = start_broker(config='[leases]\nheartbeat_ttl = "1h"\n[probe]\nrefresh_interval = "1s"\n')
    pidfile = tmp_path / "child.pid"
    run = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "sh", "-c",
                            f"echo $$ > {pidfile}; exec sleep 60"], env=broker.env, stderr=subprocess.PIPE)
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip() and leased(broker))
    child = int(pidfile.read_text())
    from vaccel.session.connection import BrokerConnection

    from vaccel_common.v1 import broker_pb2 as pb

    conn = BrokerConnection(broker.socket)  # poll in-process: a CLI start costs more than the budget

    def any_leased() -> bool:
        return any(d.state == "leased" for d in conn.call("Status", pb.StatusRequest()).devices)

    assert any_leased()
    run.send_signal(signal.SIGKILL)
    run.wait()
    killed_at = time.monotonic()
    wait_for(lambda: not any_leased(), interval=0.01)
    freed_after = time.monotonic() - killed_at
    conn.close()
    print(f"\ndevice freed {freed_after:.2f}s after the holder died (heartbeat TTL 1h)")
    wait_for(lambda: not alive(child))


def test_signals_are_forwarded_to_the_command(broker: Broker, tmp_path: Path):
    marker = tmp_path / "got"
    script = f"trap 'echo TERM > {marker}; exit 42' TERM; echo ready; while true; do sleep 0.1; done"
    run = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "sh", "-c", script],
                           env=broker.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.stdout.readline().strip() == "ready"
    run.send_signal(signal.SIGTERM)
    assert run.wait(10) == 42
    assert marker.read_text().strip() == "TERM"
    wait_for(lambda: not leased(broker))


def test_lease_context_manager_applies_env_and_releases(broker: Broker):
    code = """
        import os, vaccel
        with vaccel.lease(gpus=2, min_memory="40GiB") as l:
            same = os.environ["CUDA_VISIBLE_DEVICES"] == l.env["CUDA_VISIBLE_DEVICES"]
            print(l.id, l.backend, len(l.devices), same)
            print(sorted(d.memory_mib for d in l.devices))
            import subprocess, sys
            cli = [sys.executable, "-m", "vaccel.cli", "status", "--json"]
            out = subprocess.run(cli, capture_output=True, text=True)
            import json
            print(sum(d["state"] == "leased" for d in json.loads(out.stdout)["devices"]))
        print("after", "CUDA_VISIBLE_DEVICES" in os.environ)

        @vaccel.lease(gpus=1)
        def job():
            return os.environ["VACCEL_LEASE_ID"]
        print("decorated", job().startswith("l-"), job() != job())
    """
    p = python(broker, code)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    lines = out.splitlines()
    lease_id, backend, n, same = lines[0].split()
    assert lease_id.startswith("l-") and backend == "cuda" and n == "2" and same == "True"
    assert all(m >= 40 * 1024 for m in json.loads(lines[1]))
    assert lines[2] == "2"
    assert lines[3] == "after False"
    assert lines[4] == "decorated True True"
    assert leased(broker) == []


def test_lease_released_on_exception_and_sigterm(broker: Broker):
    p = python(broker, """
        import vaccel
        try:
            with vaccel.lease() as l:
                raise ValueError("boom")
        except ValueError:
            print("raised")
    """)
    out, err = p.communicate(timeout=60)
    assert out.strip() == "raised", err
    assert leased(broker) == []
    p = python(broker, """
        import time, vaccel
        with vaccel.lease() as l:
            print(l.id, flush=True)
            time.sleep(60)
    """)
    lease_id = p.stdout.readline().strip()
    assert lease_id.startswith("l-"), p.stderr.read()
    p.send_signal(signal.SIGTERM)
    p.wait(10)
    assert p.returncode == 128 + signal.SIGTERM
    leases = json.loads(broker.vaccel("leases", "--ended", "--json").stdout)["leases"]
    states = {lease["id"]: lease["state"] for lease in leases}
    # This lease's own end: had the holder just died, the broker would still end it (as
    # holder_exited), and the released lease of the first block is in this list too.
    assert states.get(lease_id) == "released", "SIGTERM unwinds the with-block and releases, not just holder exit"


def test_revoked_lease_is_noticed_by_the_main_thread(broker: Broker):
    p = python(broker, """
        import time, vaccel
        from vaccel import LeaseLost
        with vaccel.lease() as l:
            print(l.id, flush=True)
            try:
                for _ in range(400):
                    time.sleep(0.05)
                print("not told")
            except LeaseLost as exc:
                print("lost:", exc)
                try:
                    l.check()
                except LeaseLost:
                    print("check raises too")
    """)
    lease_id = p.stdout.readline().strip()
    r = broker.vaccel("release", lease_id, "--reason", "maintenance")
    assert r.returncode == 0, r.stderr
    out, err = p.communicate(timeout=30)
    assert "lost:" in out and "maintenance" in out, out + err
    assert "check raises too" in out


def test_missed_heartbeats_expire_the_lease(broker: Broker):
    p = python(broker, """
        import time, vaccel
        with vaccel.lease(on_lost=lambda l, why: print("lost:", why, flush=True)) as l:
            print(l.id, flush=True)
            time.sleep(60)
    """)
    lease_id = p.stdout.readline().strip()
    os.kill(p.pid, signal.SIGSTOP)  # a hung process: no heartbeats, but alive
    try:
        wait_for(lambda: not leased(broker))
        leases = json.loads(broker.vaccel("leases", "--ended", "--json").stdout)["leases"]
        ended = next(lease for lease in leases if lease["id"] == lease_id)
        assert ended["state"] == "expired" and "heartbeat" in ended["end_reason"]
    finally:
        os.kill(p.pid, signal.SIGCONT)
    assert "lost:" in p.stdout.readline()
    p.kill()
    p.wait()


def test_ctrl_c_while_queued_leaves_the_queue(broker: Broker):
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--gpus", "4", "--", "sleep", "3600"],
                              env=broker.env, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(leased(broker)) == 4)
        waiter = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "true"], env=broker.env,
                                  stderr=subprocess.PIPE, text=True)
        wait_for(lambda: status(broker)["queue"])
        waiter.send_signal(signal.SIGINT)
        assert waiter.wait(10) == 130
        wait_for(lambda: status(broker)["queue"] == [])
        waiter = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "true"], env=broker.env,
                                  stderr=subprocess.PIPE, text=True)
        wait_for(lambda: status(broker)["queue"])
        waiter.kill()
        waiter.wait()
        wait_for(lambda: status(broker)["queue"] == [])
    finally:
        holder.terminate()
        holder.wait(10)


def test_release_errors_are_one_line(broker: Broker):
    r = broker.vaccel("release", "l-doesnotexist")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "no lease" in r.stderr
    r = broker.vaccel("run", "--gpus", "0", "--", "true")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = broker.vaccel("run", "--wait", "soon", "--", "true")
    assert r.returncode == 2 and "not a duration" in r.stderr


def test_unreachable_broker_is_a_clear_error(tmp_path: Path):
    env = {**os.environ, "VACCEL_SOCKET": str(tmp_path / "nothing.sock")}
    r = subprocess.run([sys.executable, "-m", "vaccel.cli", "status"], env=env, capture_output=True, text=True)
    assert r.returncode == 69
    assert "cannot reach the vaccel broker" in r.stderr and "Traceback" not in r.stderr


# -- bad input straight at the gRPC API ------------------------------------------------


@pytest.fixture
def connection(broker: Broker):
    from vaccel.session.connection import BrokerConnection

    conn = BrokerConnection(broker.socket)
    yield conn
    conn.close()


def _acquire_code(conn, **fields) -> grpc.StatusCode:
    from vaccel_common.v1 import broker_pb2 as pb

    try:
        for _ in conn.stream("Acquire", pb.AcquireRequest(**fields), timeout=10):
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_absurd_values_get_precise_status_codes(broker: Broker, connection):
    from vaccel_common.v1 import broker_pb2 as pb

    assert _acquire_code(connection, gpus=0) == grpc.StatusCode.INVALID_ARGUMENT
    assert _acquire_code(connection, gpus=10**9) == grpc.StatusCode.INVALID_ARGUMENT
    assert _acquire_code(connection, gpus=1, min_memory_mib=-5) == grpc.StatusCode.INVALID_ARGUMENT
    assert _acquire_code(connection, gpus=1, max_wait_seconds=-1) == grpc.StatusCode.INVALID_ARGUMENT
    assert _acquire_code(connection, gpus=1, max_wait_seconds=float("nan")) == grpc.StatusCode.INVALID_ARGUMENT
    assert _acquire_code(connection, gpus=5) == grpc.StatusCode.FAILED_PRECONDITION
    assert _acquire_code(connection, gpus=1, runtime_spec_yaml="x" * (2 << 20)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _acquire_code(connection, gpus=1, runtime_spec_yaml="a: [1,") == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        connection.call("Heartbeat", pb.LeaseRef(lease_id="l-unknown"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    # The daemon is still serving everyone.
    assert status(broker)["devices"]


def test_forged_or_missing_token_is_unauthenticated(broker: Broker):
    from vaccel_common.v1 import broker_pb2 as pb
    from vaccel_common.v1 import broker_pb2_grpc

    channel = grpc.insecure_channel(f"unix:{broker.socket}")
    stub = broker_pb2_grpc.BrokerStub(channel)
    for metadata in ((), (("vaccel-token", "e30.AAAA"),), (("vaccel-token", "garbage"),)):
        with pytest.raises(grpc.RpcError) as info:
            stub.Status(pb.StatusRequest(), metadata=metadata, timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A token claiming uid 0 but signed with another key is refused too.
    from brokerd.base.process import Identity
    from brokerd.edge.identity import TokenAuthority

    forged, _ = TokenAuthority(b"k" * 32, 60).mint(Identity(0, 0, os.getpid(), 1))
    with pytest.raises(grpc.RpcError) as info:
        stub.Status(pb.StatusRequest(), metadata=(("vaccel-token", forged),), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_garbage_on_the_sockets_does_not_kill_the_daemon(broker: Broker):
    import socket as socketlib

    for path in (broker.socket, broker.socket.with_name(broker.socket.name + ".id")):
        s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        s.connect(str(path))
        try:
            s.sendall(os.urandom(4096))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon may hang up on garbage before it is all sent: allowed, and it lives on
        s.close()
    assert status(broker)["devices"]


def drained_by_me(reason: str) -> str:
    """The drain reason as recorded: with who and when, as Slurm keeps a node's ("fan [root@2025-12-03T10:02:00]")."""
    return rf"{re.escape(reason)} \[{re.escape(pwd.getpwuid(os.getuid()).pw_name)}@\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d\]"


def test_admin_drain_keeps_a_device_out_of_the_pool(broker: Broker):
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "sleep", "3600"], env=broker.env,
                              stderr=subprocess.PIPE)
    try:
        held = wait_for(lambda: leased(broker))[0]
        index = next(d["index"] for d in status(broker)["devices"] if d["uuid"] == held)
        r = broker.vaccel("drain", f"gpu{index}", "--reason", "fan noise")
        assert r.returncode == 0 and "runs to its end" in r.stdout, r.stderr
        other = (index + 1) % 4
        r = broker.vaccel("drain", str(other), "--reason", "flaky")
        assert r.returncode == 0
        devices = {d["index"]: d for d in status(broker)["devices"]}
        assert devices[other]["state"] == "drained"
        assert re.fullmatch(drained_by_me("flaky"), devices[other]["drain_reason"])
        assert devices[index]["state"] == "leased"
        assert re.fullmatch(drained_by_me("fan noise"), devices[index]["drain_reason"])
        holder.terminate()
        holder.wait(10)
        wait_for(lambda: not leased(broker))
        assert status(broker)["devices"][index]["state"] == "drained"
        r = broker.vaccel("run", "--gpus", "3", "--no-wait", "--", "true")
        assert r.returncode == 75 and "drained" in r.stderr
        assert broker.vaccel("drain", str(other), "--undo").returncode == 0
        assert status(broker)["devices"][other]["state"] == "free"
        r = broker.vaccel("drain", "gpu9")
        assert r.returncode == 1 and "no device" in r.stderr
    finally:
        holder.kill()
        holder.wait()


def test_cli_usage_errors_are_one_line(broker: Broker):
    env = {k: v for k, v in broker.env.items() if k != "VACCEL_SOCKET"}
    r = broker.vaccel("--socket", str(broker.socket), "status", env=env)
    assert r.returncode == 0, "--socket before the command is honoured"
    r = broker.vaccel("run", "--contract", "no-such-spec.yaml", "--", "true")
    assert r.returncode == 2 and "no-such-spec.yaml" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "brokerd", "--config", "/nonexistent/brokerd.toml"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "no such configuration file" in r.stderr


def test_a_memory_size_without_a_unit_is_refused_with_a_hint(broker: Broker):
    """`--min-memory 20` would be 20 bytes, which nobody means: say so, don't lease."""
    r = broker.vaccel("run", "--min-memory", "20", "--", "true")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == "vaccel: --min-memory 20: give a unit, e.g. 20GiB or 20MiB"
    assert broker.vaccel("run", "--min-memory", "20GiB", "--", "true").returncode == 0
