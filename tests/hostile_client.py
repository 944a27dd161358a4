"""What a hostile local user does to the broker, one attack per subcommand; run as that
user by tests/test_hostile.py (from the world-readable staged copy). Prints one JSON line
with what it saw.

    python hostile_client.py malformed          bombs, deep YAML, NUL, undecodable, non-UTF-8
    python hostile_client.py flood SECONDS N    N threads of Check with a legal large spec
    python hostile_client.py connections N S    N idle connections held for S seconds
    python hostile_client.py inject             a lease whose commands carry terminal escapes
    python hostile_client.py token FILE         write this process's token and exit
    python hostile_client.py join LEASE FILE    Join LEASE with the token in FILE
    python hostile_client.py side LEASE N       the identity socket's calls: release LEASE there,
                                                garbage, endless and huge headers; then hold N
                                                connections open
    python hostile_client.py reports N ROUNDS   N usage reports at once, given up after 2 to 50 ms
    python hostile_client.py views SECONDS N    N threads asking for the status view without pause,
                                                as many connections again held open, silent
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from vaccel.session.connection import BrokerConnection

from vaccel_common.auth import TOKEN_METADATA_KEY
from vaccel_common.paths import identity_socket
from vaccel_common.side_call import parse_reply_header, request_header
from vaccel_common.v1 import broker_pb2 as pb


def alias_bomb(levels: int) -> str:
    """Each level nine references to the one below (the issue's 321-byte spec at 9)."""
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def large_legal_spec(kib: int) -> str:
    deps, i = [], 0
    while sum(map(len, deps)) < kib * 1024:
        deps.append(f"  - name: package-number-{i}\n    version_range: \">=1.0,<99\"\n")
        i += 1
    return "dependencies:\n" + "".join(deps)


def code_of(call) -> str:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def malformed() -> dict:
    c = BrokerConnection()
    out = {}
    for name, spec in {"bomb": alias_bomb(9), "deep": "[" * 100_000 + "]" * 100_000,
                       "nul": "dependencies:\n  - name: a\0b\n", "anchor": "a: &x 1\nb: *x\n"}.items():
        out[name] = code_of(lambda s=spec: c.call("Check", pb.CheckRequest(runtime_spec_yaml=s), timeout=30))
        out[name + "_acquire"] = code_of(lambda s=spec: next(iter(c.stream(
            "Acquire", pb.AcquireRequest(gpus=1, runtime_spec_yaml=s), timeout=30))))
    stub_channel = grpc.insecure_channel(f"unix:{c.path}")
    raw = stub_channel.unary_unary("/vaccel.v1.Broker/Check")
    good = pb.CheckRequest(runtime_spec_yaml="a").SerializeToString()
    for name, payload in {"undecodable": b"\xff\xff\xff\xff\x0f", "non_utf8": good.replace(b"a", b"\xff"),
                          "truncated": good[:-1]}.items():
        out[name] = code_of(lambda p=payload: raw(p, timeout=30, metadata=c.metadata()))
    return out


def flood(threads: int) -> dict:
    """Check requests from `threads` threads until SIGTERM. Prints one line once the first
    answer is back (the flood is on), the answers' codes when it stops."""
    spec = large_legal_spec(175)
    facts = pb.ClientFacts(python_version="3.11.4", packages={f"package-number-{i}": "2.0" for i in range(0, 4000, 2)})
    codes: Counter[str] = Counter()
    stopping, answered = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())

    def worker() -> None:
        c = BrokerConnection()
        n = 0
        while not stopping.is_set():
            # Each one different: the broker remembers a requirement it has made, so a
            # flood of one spec repeated would cost it nothing to refuse.
            n += 1
            request = pb.CheckRequest(runtime_spec_yaml=f"{spec}\n# {threading.get_ident()} {n}\n", client=facts)
            codes[code_of(lambda r=request: c.call("Check", r, timeout=60))] += 1
            answered.set()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    answered.wait()
    print(json.dumps({"flooding": True}), flush=True)
    for t in pool:
        t.join()
    return dict(codes)


def connections(count: int, hold_s: float) -> dict:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 256), hard))
    path = str(BrokerConnection().path)
    held, failed = [], 0
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            held.append(s)
        except OSError:
            failed += 1
            s.close()
    print(json.dumps({"opened": len(held), "failed": failed}), flush=True)
    time.sleep(hold_s)
    return {"opened": len(held)}


def side_exchange(path: str, payload: bytes, timeout: float = 30) -> tuple[bytes, bytes]:
    """Send `payload` on the identity socket; (token line, everything after it). A daemon
    that hangs up without reading what we sent resets the connection: that is an end too.
    (tests/test_side_calls.py uses it as well.)"""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        data = b""
        try:
            s.sendall(payload)
            while chunk := s.recv(65536):
                data += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass
    line, _, rest = data.partition(b"\n")
    return line, rest


def _side(path: str, payload: bytes) -> str:
    """What the identity socket answers to `payload` after the token line."""
    _, rest = side_exchange(path, payload)
    header = parse_reply_header(rest.partition(b"\n")[0]) if rest else None
    return f"reply {header[0]}" if header else "no reply"


def side(victim_lease: str, hold: int) -> dict:
    path = str(identity_socket(BrokerConnection().path))
    release = pb.ReleaseRequest(lease_id=victim_lease, reason="mine now").SerializeToString()
    out = {"release_other": _side(path, request_header("Release", len(release)) + release),
           "garbage": _side(path, os.urandom(4096)),
           "endless_header": _side(path, b"CALL " + b"A" * 200_000),
           "huge": _side(path, b"CALL TryAcquire 999999999\n")}
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, hold + 256), hard))
    held = []
    for _ in range(hold):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.recv(4096)  # the token line; then silence
        held.append(s)
    time.sleep(0.5)
    still_open = 0
    for s in held:
        s.setblocking(False)
        try:
            still_open += s.recv(1) != b""
        except BlockingIOError:
            still_open += 1  # nothing to read and not closed: the daemon waits on it
        except OSError:
            pass
    out["held_open"] = still_open
    print(json.dumps(out), flush=True)
    time.sleep(30)  # the test runs a well-behaved user meanwhile, then stops us
    return out


def inject() -> dict:
    """Two leases shown to others: one whose command the client names with escapes, one
    with no command, so the daemon falls back to this process's /proc cmdline (which the
    test sets through `exec -a`)."""
    c = BrokerConnection()
    evil = "\x1b[2J\x1b[Hgpu0 root FAKE\nvaccel-bob: \x07 owned\r"
    leases = []
    for command in (evil, ""):
        # Read the stream to its end: dropping it early cancels the call, which hands the grant back.
        *_, update = c.stream("Acquire", pb.AcquireRequest(gpus=1, command=command), timeout=30)
        assert update.HasField("granted"), update
        leases.append(update.granted.id)

    def beat() -> None:  # hold both leases while the test looks at them
        while True:
            for lease_id in leases:
                code_of(lambda i=lease_id: c.call("Heartbeat", pb.LeaseRef(lease_id=i), timeout=10))
            time.sleep(0.3)

    threading.Thread(target=beat, daemon=True).start()
    forged = "evil\n2026-01-01 00:00:00 INFO grant lease=l-FORGED user=root"
    spec = f'dependencies:\n  - name: {json.dumps(forged)}\n    version_range: ">=1"\n'
    facts = pb.ClientFacts(python_version="3.11.4", packages={forged: "0.1\nINFO grant lease=l-FORGED"})
    refused = code_of(lambda: next(iter(c.stream(
        "Acquire", pb.AcquireRequest(gpus=1, runtime_spec_yaml=spec, client=facts), timeout=30))))
    print(json.dumps({"held": 2, "refused": refused}), flush=True)
    time.sleep(60)
    return {}


def reports(threads: int, rounds: int) -> dict:
    """Reports over a year by day, each given up after a few milliseconds, some while they
    wait for the accounting thread, some while it works on them: the daemon cancels them."""
    codes: Counter[str] = Counter()
    c = BrokerConnection()
    c.call("Status", pb.StatusRequest())  # connected and identified: the deadlines are the report's alone
    request = pb.ReportRequest(since=time.time() - 366 * 86400, by="day")

    def one(deadline_s: float) -> None:
        codes[code_of(lambda: c.call("Report", request, timeout=deadline_s))] += 1

    for _ in range(rounds):
        pool = [threading.Thread(target=one, args=((0.002, 0.005, 0.01, 0.02, 0.05)[i % 5],)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    return dict(codes)
def views(seconds: float, threads: int) -> dict:
    """The ready-made `vaccel status` (vaccel/entry.py) asked for as fast as one user can, while
    as many connections sit on the identity socket saying nothing: what do the asks get?"""
    path = str(identity_socket(BrokerConnection().path))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * threads + 256), hard))
    held = []
    for _ in range(threads):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)  # the token line comes; no request follows (each takes a slot until it times out)
        held.append(s)
    seen: Counter[str] = Counter()
    stop = time.monotonic() + seconds

    def worker() -> None:
        while time.monotonic() < stop:
            try:
                seen[_side(path, request_header("StatusText", 0))] += 1
            except OSError as exc:
                seen[type(exc).__name__] += 1

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    print(json.dumps({"started": threads}), flush=True)
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    for s in held:
        s.close()
    print(json.dumps(dict(seen)), flush=True)
    return dict(seen)


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "malformed":
        result = malformed()
    elif mode == "flood":
        result = flood(int(args[0]))
    elif mode == "connections":
        result = connections(int(args[0]), float(args[1]))
    elif mode == "inject":
        result = inject()
    elif mode == "side":
        result = side(args[0], int(args[1]))
    elif mode == "reports":
        result = reports(int(args[0]), int(args[1]))
    elif mode == "views":
        result = views(float(args[0]), int(args[1]))
    elif mode == "token":
        c = BrokerConnection()
        c.call("Status", pb.StatusRequest())
        Path(args[0]).write_text(dict(c.metadata())[TOKEN_METADATA_KEY])
        result = {"pid": os.getpid()}
    elif mode == "join":
        token = Path(args[1]).read_text()
        channel = grpc.insecure_channel(f"unix:{BrokerConnection().path}")
        join = channel.unary_unary("/vaccel.v1.Broker/Join", request_serializer=pb.LeaseRef.SerializeToString,
                                   response_deserializer=pb.Lease.FromString)
        result = {"join": code_of(lambda: join(pb.LeaseRef(lease_id=args[0]), timeout=30,
                                               metadata=((TOKEN_METADATA_KEY, token),)))}
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
