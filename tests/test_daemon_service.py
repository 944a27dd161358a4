"""The daemon as a service, without booting systemd: the notify protocol against a socket
the test binds as NOTIFY_SOCKET, SIGHUP reload, SIGTERM shutdown and restart."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import DEFAULT_CONFIG, LAB_INVENTORY, Broker
from tests.test_broker_integration import leased, status, wait_for


class NotifyListener:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, str]] = []

    def read(self, until: str, timeout: float = 20.0) -> list[str]:
        """Collect datagrams until one contains `until`; return the new ones."""
        deadline = time.monotonic() + timeout
        new: list[str] = []
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                break
            self.messages.append((time.monotonic(), data))
            new.append(data)
            if until in data:
                return new
        raise AssertionError(f"no {until!r} from the daemon; got {new}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notified() -> tuple[Broker, NotifyListener]:
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-n-"))
    listener = NotifyListener(workdir / "notify.sock")
    broker = Broker(workdir, LAB_INVENTORY, DEFAULT_CONFIG)
    broker.env = {**broker.env, "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "400000"}
    yield broker, listener
    broker.stop()
    listener.close()


def test_ready_only_when_listening_then_status_watchdog_and_stopping(notified):
    broker, listener = notified
    broker.proc = subprocess.Popen(broker.command(), env=broker.env, stdout=broker.log.open("ab"),
                                   stderr=subprocess.STDOUT)
    listener.read("READY=1")
    # READY promised the sockets: connecting must work right now, not "soon".
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(str(broker.socket.with_name(broker.socket.name + ".id")))
    probe.close()
    assert any("STATUS=0/4 GPUs leased, 0 waiting, 0 unhealthy" in m for m in listener.read("STATUS="))
    # Watchdog pings at half of WATCHDOG_USEC come from the event loop.
    pings = [m for m in listener.read("WATCHDOG=1") + listener.read("WATCHDOG=1") if "WATCHDOG=1" in m]
    assert len(pings) >= 2
    # A grant shows up in the status line an admin reads in `systemctl status`.
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "sleep", "30"], env=broker.env,
                              stderr=subprocess.PIPE)
    try:
        listener.read("STATUS=1/4 GPUs leased")
    finally:
        holder.terminate()
        holder.wait(10)
    broker.proc.send_signal(signal.SIGTERM)
    listener.read("STOPPING=1")
    assert broker.proc.wait(10) == 0


def test_sighup_reloads_without_dropping_leases_and_rejects_a_bad_config(start_broker):
    broker = start_broker(config=DEFAULT_CONFIG)
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--gpus", "4", "--", "sleep", "60"],
                              env=broker.env, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(leased(broker)) == 4)
        waiter = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "true"], env=broker.env,
                                  stderr=subprocess.PIPE)
        wait_for(lambda: status(broker)["queue"])
        broker.config.write_text(DEFAULT_CONFIG.replace('"3s"', '"4s"'))
        broker.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "configuration reloaded" in broker.log.read_text())
        broker.config.write_text("[leases]\nheartbeat_tll = '5s'\n")
        broker.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "configuration rejected" in broker.log.read_text())
        assert "did you mean" in broker.log.read_text() or "unknown key" in broker.log.read_text()
        assert len(leased(broker)) == 4, "reload kept every lease"
        assert len(status(broker)["queue"]) == 1, "reload kept the queue"
        assert broker.proc.poll() is None
    finally:
        holder.terminate()
        holder.wait(10)
    assert waiter.wait(20) == 0, "the queued request was granted after the reloads"


def test_a_burst_of_grants_sends_systemd_a_few_status_lines_and_the_last_state(notified):
    # Every grant and release is a change. A STATUS= datagram for each woke PID 1 two
    # thousand times a second under load, for a line an admin reads in `systemctl status`;
    # and a notify socket whose reader lags (ten datagrams queue) blocked the event loop.
    broker, listener = notified
    broker.proc = subprocess.Popen(broker.command(), env=broker.env, stdout=broker.log.open("ab"),
                                   stderr=subprocess.STDOUT)
    listener.read("READY=1")
    listener.read("STATUS=")
    cycles = ("from vaccel.session.lease_session import LeaseRequest, LeaseSession\n"
              "with LeaseSession() as s:\n"
              "    for _ in range(60):\n"
              "        s.acquire(LeaseRequest(gpus=1)); s.release()\n")
    began = time.monotonic()
    burst = subprocess.Popen([broker.python, "-c", cycles], env=broker.env, stderr=subprocess.PIPE, text=True)
    # The 300 s only turn a hang into a failure (a loaded machine's burst takes seconds).
    while burst.poll() is None and time.monotonic() - began < 300:  # read as systemd does, as they come
        with contextlib.suppress(AssertionError):
            listener.read("no such message", timeout=0.05)
    took = time.monotonic() - began
    assert burst.poll() == 0, f"the burst did not finish: {burst.communicate(timeout=60)[1][-500:]}"
    final = "STATUS=0/4 GPUs leased, 0 waiting, 0 unhealthy"
    every = [m for _, m in listener.messages if m.startswith("STATUS=")]
    if every[-1] != final:  # the line due after the burst: waited for, not for 1.5 s
        listener.read(final, timeout=60)
    every = [m for _, m in listener.messages if m.startswith("STATUS=")]
    assert every[-1] == final, every[-3:]
    lines = [m for at, m in listener.messages if at >= began and m.startswith("STATUS=")]
    assert len(lines) <= took / 0.5 + 3, f"{len(lines)} status lines for 120 changes in {took:.1f}s"
    broker.proc.send_signal(signal.SIGTERM)
    assert broker.proc.wait(10) == 0
