"""What a hostile local user does to the daemon's HTTP servers (the dashboard, /metrics),
one attack per subcommand; run as that user by tests/test_hostile_surfaces.py. Plain
sockets only: a real browser or curl would back off, an attacker does not. Prints one
JSON line with what it got, then holds what it opened until it is stopped.

    python hostile_http.py streams PORT N           N event streams of the dashboard
    python hostile_http.py keepalive PORT N         N keep-alive connections, each used now and then
    python hostile_http.py trickle PORT N           N requests sent one byte a second, never finished
    python hostile_http.py abandon PORT N ROUNDS    N usage reports at once, each dropped after 50 ms
    python hostile_http.py garbage PORT             requests that do not parse
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import threading
import time
from collections import Counter


def request(port: int, path: str, *, keep_alive: bool = False) -> bytes:
    connection = "keep-alive" if keep_alive else "close"
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: {connection}\r\n\r\n".encode()


def status_of(sock: socket.socket) -> str:
    """The status code of the reply on `sock`, or what happened instead."""
    try:
        head = sock.recv(64)
    except OSError as exc:
        return type(exc).__name__
    return head.split(b" ")[1].decode() if head.startswith(b"HTTP/1.1 ") else "closed"


def connect(port: int) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError:
        return None


def streams(port: int, count: int) -> list[socket.socket]:
    held, seen = [], Counter()
    for _ in range(count):
        sock = connect(port)
        if sock is None:
            seen["refused"] += 1
            continue
        try:
            sock.sendall(request(port, "/events", keep_alive=True))
        except OSError:
            seen["reset"] += 1
            continue
        code = status_of(sock)
        seen[code] += 1
        if code == "200":
            held.append(sock)
    report(dict(seen))
    return held


def keepalive(port: int, count: int) -> list[socket.socket]:
    """Connections that each got one reply and stay open, asking again every 10 s (the
    server closes a connection idle for 15 s)."""
    held, seen = [], Counter()
    for _ in range(count):
        sock = connect(port)
        if sock is None:
            seen["refused"] += 1
            continue
        try:
            sock.sendall(request(port, "/api/status", keep_alive=True))
            code = status_of(sock)
            sock.recv(1 << 20)  # the rest of the reply
        except OSError as exc:
            code = type(exc).__name__
        seen[code] += 1
        if code == "200":
            held.append(sock)
    report(dict(seen))

    def again() -> None:
        while True:
            time.sleep(10)
            for sock in held:
                try:
                    sock.sendall(request(port, "/api/status", keep_alive=True))
                    sock.recv(1 << 20)
                except OSError:
                    pass

    threading.Thread(target=again, daemon=True).start()
    return held


def trickle(port: int, count: int) -> list[socket.socket]:
    held = [sock for sock in (connect(port) for _ in range(count)) if sock is not None]
    report({"opened": len(held)})
    text = request(port, "/metrics")

    def drip() -> None:
        for byte in text[:-2]:  # never the blank line that ends the request
            for sock in held:
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    pass
            time.sleep(1)

    threading.Thread(target=drip, daemon=True).start()
    return held


def abandon(port: int, count: int, rounds: int) -> None:
    seen: Counter[str] = Counter()

    def one() -> None:
        sock = connect(port)
        if sock is None:
            seen["refused"] += 1
            return
        with sock:
            sock.sendall(request(port, "/api/report?since=366d&by=day"))
            time.sleep(0.05)
        seen["abandoned"] += 1

    for _ in range(rounds):
        threads = [threading.Thread(target=one) for _ in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report(dict(seen))


def garbage(port: int) -> None:
    seen = Counter()
    for payload in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64),
                    b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\nBroken header line\r\n\r\n",
                    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n\r\n",
                    b"BREW /pot HTCPCP/1.0\r\n\r\n"):
        sock = connect(port)
        if sock is None:
            seen["refused"] += 1
            continue
        with sock:
            sock.sendall(payload)
            seen[status_of(sock)] += 1
    report(dict(seen))


def report(what: dict) -> None:
    print(json.dumps(what), flush=True)


def main() -> None:
    mode, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[socket.socket] = []
    if mode == "streams":
        held = streams(*args)
    elif mode == "keepalive":
        held = keepalive(*args)
    elif mode == "trickle":
        held = trickle(*args)
    elif mode == "abandon":
        return abandon(*args)
    elif mode == "garbage":
        return garbage(*args)
    else:
        raise SystemExit(f"unknown mode {mode}")
    time.sleep(120)  # the test runs a well-behaved user meanwhile, then stops us
    del held


if __name__ == "__main__":
    main()
