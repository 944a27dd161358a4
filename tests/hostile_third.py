"""A hostile local user's attacks of the third pass (issue 43), one per subcommand; run as
that user by tests/test_hostile_third.py from the world-readable staged copy. Prints JSON
lines with what it saw.

    python hostile_third.py tokenfree N       N health Watch streams with 1 MB names, twice
                                              the daemon's token-free stream cap of known
                                              ones, a 1 MB reflection symbol, N idle
                                              connections; then holds everything open
    python hostile_third.py abandon T R       T threads, R rounds of Status and ListLeases given
                                              up after 1 to 5 ms
    python hostile_third.py attach N CROWD    N AttachContainer calls naming a non-init process
                                              of a pid namespace of hers, CROWD more processes up
    python hostile_third.py runnow N KIB      N quick runs (RunNow) with a KIB accelerator config
    python hostile_third.py shares N MIB      N reserved memory shares of MIB each, one after another
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from vaccel.session.connection import BrokerConnection

from vaccel_common.paths import identity_socket
from vaccel_common.side_call import parse_reply_header, request_header
from vaccel_common.v1 import broker_pb2 as pb

MB = 1 << 20
OWN = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel, not one shared by all


def _first(stream) -> str:
    """The first thing a stream says: a status name, or the code it ended with."""
    try:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(next(stream).status)
    except grpc.RpcError as exc:
        return exc.code().name
    except StopIteration:
        return "ENDED"


def tokenfree(n: int) -> dict:
    path = f"unix:{BrokerConnection().path}"
    held: list = []
    seen: dict[str, Counter[str]] = {"big": Counter(), "unknown": Counter(), "known": Counter()}
    for i in range(n):  # each on its own connection, each name unique and 1 MB
        channel = grpc.insecure_channel(path, options=[("grpc.max_send_message_length", 2 * MB), *OWN])
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=f"{i}-" + "x" * (MB - 64)), timeout=600)
        seen["big"][_first(stream)] += 1
        held += [channel, stream]
    channel = grpc.insecure_channel(path)
    held.append(channel)
    health = health_pb2_grpc.HealthStub(channel)
    for i in range(8):
        seen["unknown"][_first(health.Watch(health_pb2.HealthCheckRequest(service=f"no.such.S{i}"), timeout=600))] += 1
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    try:
        reply = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="x" * (MB - 64))]), timeout=60))
        symbol = "error_response" if reply.HasField("error_response") else "answered"
    except grpc.RpcError as exc:
        symbol = exc.code().name
    for _ in range(128):
        stream = health.Watch(health_pb2.HealthCheckRequest(service="vaccel.v1.Broker"), timeout=600)
        seen["known"][_first(stream)] += 1
        held.append(stream)
    idle = []
    for _ in range(n):  # connected and handshaken, then silent
        c = grpc.insecure_channel(path, options=OWN)
        grpc.channel_ready_future(c).result(timeout=30)
        idle.append(c)
    out = {k: dict(v) for k, v in seen.items()} | {"symbol": symbol, "idle": len(idle)}
    print(json.dumps(out), flush=True)
    time.sleep(600)  # the test looks at the daemon meanwhile, then stops us
    return out


def shares(n: int, mib: int) -> dict:
    """N reservations of a MIB share each (a reservation needs no heartbeat: they stay)."""
    c = BrokerConnection()
    codes: Counter[str] = Counter()
    longest = 0
    for _ in range(n):
        request = pb.AcquireRequest(gpus=1, memory_mib=mib, reservation=True, time_limit_s=3600)
        try:
            update = c.call("TryAcquire", request, timeout=30)
            codes["granted" if update.HasField("granted") else "other"] += 1
        except grpc.RpcError as exc:
            codes[exc.code().name] += 1
            longest = max(longest, len(exc.details() or ""))
    out = {"codes": dict(codes), "longest_refusal": longest}
    print(json.dumps(out), flush=True)
    return out


def abandon(threads: int, rounds: int) -> dict:
    """Calls given up after 1 to 5 ms, many at once: each answer the daemon then cannot send
    used to be a journal line of its own."""
    c = BrokerConnection()
    c.call("Status", pb.StatusRequest())  # connected and identified: the deadlines are the calls' alone
    codes: Counter[str] = Counter()

    def one(i: int) -> None:
        for _ in range(rounds):
            for method, request in (("Status", pb.StatusRequest()), ("ListLeases", pb.ListLeasesRequest())):
                try:
                    c.call(method, request, timeout=(0.001, 0.002, 0.003, 0.005)[i % 4])
                    codes["OK"] += 1
                except grpc.RpcError as exc:
                    codes[exc.code().name] += 1

    pool = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return dict(codes)


def big_config(kib: int) -> str:
    """A legal accelerator config of about `kib` KiB: a memory section and many priorities."""
    lines = ["rocm_config: {memory_pool_size_mb: 4096, use_unified_memory: true}", "device_selection_policy:"]
    i = 1
    while sum(map(len, lines)) < kib * 1024:
        lines.append(f"  - priority: {i}\n    criteria: [{{type: gpu_vendor, equals: amd}}, "
                     f"{{type: driver_version, min: 6.{i}.0}}]")
        i += 1
    return "\n".join(lines) + "\n"


def _unpacked(payload: bytes) -> list[bytes]:
    fields = []
    while payload:
        length, _, payload = payload.partition(b"\n")
        fields.append(payload[:int(length)])
        payload = payload[int(length):]
    return fields


def runnow(n: int, kib: int) -> dict:
    """N quick runs (RunNow on the identity socket, as a plain `vaccel run` asks) carrying a
    large accelerator config, each granted and given back at once."""
    c = BrokerConnection()
    path = str(identity_socket(c.path))
    config = big_config(kib)
    seen: Counter[str] = Counter()
    for _ in range(n):
        body = pb.AcquireRequest(gpus=1, accelerator_config_yaml=config, command="quick").SerializeToString()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(60)
            s.connect(path)
            s.sendall(request_header("RunNow", len(body)) + body)
            data = b""
            while chunk := s.recv(1 << 16):
                data += chunk
        _token, _, rest = data.partition(b"\n")
        header, _, payload = rest.partition(b"\n")
        code, _length = parse_reply_header(header) or (-1, 0)
        fields = _unpacked(payload) if code == 0 else []
        if fields and fields[0] == b"granted":
            seen["granted"] += 1
            env = dict(kv.split("=", 1) for kv in fields[4].decode().split("\0") if kv)
            seen[f"cap={env.get('VACCEL_MEMORY_CAP_MIB')} xnack={env.get('HSA_XNACK')}"] += 1
            c.call("Release", pb.ReleaseRequest(lease_id=fields[1].decode(), reason="quick"))
        else:
            seen[f"code {code}" if code else fields[0].decode()] += 1
    return dict(seen)


def code_of_call(call) -> str:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def attach(n: int, crowd: int) -> dict:
    """N AttachContainer calls naming, as a container's init, a process of alice's that is
    in a pid namespace of its own but is not its init (each refused), with `crowd` more
    processes of hers on the host (each refusal used to look through all of /proc)."""
    c = BrokerConnection()
    lease = c.call("TryAcquire", pb.AcquireRequest(gpus=1, command="attach"), timeout=30).granted
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.3):
            c.call("Heartbeat", pb.LeaseRef(lease_id=lease.id), timeout=10)

    threading.Thread(target=beat, daemon=True).start()
    crowds = [subprocess.Popen(["sleep", "300"]) for _ in range(crowd)]
    ns = subprocess.Popen(["unshare", "-Urpf", "sh", "-c", "sleep 300 & wait"])
    sleeper = init = None
    for _ in range(200):  # unshare -> its forked sh (pid 1 inside) -> sleep (pid 2 inside)
        inner = [(k, g) for k in _children(ns.pid) for g in _children(k)]
        if inner:
            init, sleeper = inner[0]
            break
        time.sleep(0.05)
    codes: Counter[str] = Counter()
    try:
        assert sleeper is not None, "no process in the new pid namespace"
        request = pb.AttachContainerRequest(lease_id=lease.id, init_pid=sleeper, name="not-an-init")
        for _ in range(n):
            try:
                c.call("AttachContainer", request, timeout=30)
                codes["OK"] += 1
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1
        # The namespace's init itself is what a rootless engine's client names: taken.
        real = pb.AttachContainerRequest(lease_id=lease.id, init_pid=init, name="its-init")
        codes["init: " + code_of_call(lambda: c.call("AttachContainer", real, timeout=30))] += 1
    finally:
        stop.set()
        if init:
            os.kill(init, signal.SIGKILL)  # the namespace's init: the kernel ends the rest of it
        for p in (*crowds, ns):
            p.kill()
            p.wait()
        # Ended already once its container's init is gone (holder_exited): either way, done.
        code_of_call(lambda: c.call("Release", pb.ReleaseRequest(lease_id=lease.id, reason="done")))
    return dict(codes)


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "tokenfree":
        result = tokenfree(int(args[0]))
    elif mode == "attach":
        result = attach(int(args[0]), int(args[1]))
    elif mode == "runnow":
        result = runnow(int(args[0]), int(args[1]))
    elif mode == "abandon":
        result = abandon(int(args[0]), int(args[1]))
    elif mode == "shares":
        result = shares(int(args[0]), int(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
