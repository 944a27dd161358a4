"""The sd_notify protocol against a datagram socket the test binds as NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokerd.daemon import notify
from brokerd.daemon.notify import Notifier


@pytest.fixture(autouse=True)
def _fallback_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    # Exercise our own few lines of the protocol even where systemd-python is installed.
    monkeypatch.setattr(notify, "_systemd_sender", lambda: None)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def receive(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_lifecycle_messages_arrive_in_order(listener: socket.socket) -> None:
    notifier = Notifier.from_env()
    assert notifier.enabled
    notifier.ready()
    notifier.status("3/4 GPUs leased, 2 waiting, 0 unhealthy")
    notifier.watchdog()
    notifier.stopping()
    assert [receive(listener) for _ in range(4)] == [
        "READY=1",
        "STATUS=3/4 GPUs leased, 2 waiting, 0 unhealthy",
        "WATCHDOG=1",
        "STOPPING=1",
    ]


def test_status_is_kept_on_one_line(listener: socket.socket) -> None:
    Notifier.from_env().status("first\nsecond")
    assert receive(listener) == "STATUS=first second"


def test_reloading_carries_a_monotonic_timestamp(listener: socket.socket) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    Notifier.from_env().reloading()
    first, second = receive(listener).split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC"
    assert int(value) >= before


def test_abstract_socket_name(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"vaccel-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        Notifier.from_env().ready()
        assert receive(sock) == "READY=1"


def test_noop_without_notify_socket() -> None:
    notifier = Notifier.from_env()
    assert not notifier.enabled
    notifier.ready()
    notifier.reloading()
    notifier.status("idle")
    notifier.watchdog()
    notifier.stopping()
    assert notifier.watchdog_interval_s() is None


def test_a_vanished_socket_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    notifier = Notifier.from_env()
    notifier.ready()
    notifier.watchdog()
    warnings = [r for r in caplog.records if "cannot notify systemd" in r.getMessage()]
    assert len(warnings) == 1


def test_systemd_python_sender_is_used_when_present(listener: socket.socket,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []
    monkeypatch.setattr(notify, "_systemd_sender", lambda: lambda msg: sent.append(msg) or True)
    Notifier.from_env().ready()
    assert sent == ["READY=1"]


def test_watchdog_interval_is_half_of_watchdog_usec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    assert Notifier.from_env().watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Notifier.from_env().watchdog_interval_s() == 15.0


def test_watchdog_meant_for_another_process_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert Notifier.from_env().watchdog_interval_s() is None


@pytest.mark.parametrize("value", ["", "0", "soon", "-5"])
def test_unusable_watchdog_usec_means_no_watchdog(value: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", value)
    assert Notifier.from_env().watchdog_interval_s() is None


def test_the_status_line_follows_changes_without_a_datagram_for_each() -> None:
    sent: list[str] = []
    state = ["0/4 GPUs leased"]
    line = notify.StatusLine(Notifier("/run/unused", sender=lambda m: sent.append(m) or True), lambda: state[0])

    async def scenario() -> None:
        line.send()  # start-up
        await asyncio.sleep(notify.STATUS_EVERY_S + 0.05)
        state[0] = "1/4 GPUs leased"
        line.changed()  # after a quiet spell: at once
        assert sent[-1] == "STATUS=1/4 GPUs leased"
        for n in range(2, 5):  # a burst: one line, at the end of the spell, with the state then
            state[0] = f"{n}/4 GPUs leased"
            line.changed()
        assert len(sent) == 2
        await asyncio.sleep(notify.STATUS_EVERY_S + 0.05)
        assert sent == ["STATUS=0/4 GPUs leased", "STATUS=1/4 GPUs leased", "STATUS=4/4 GPUs leased"]
        line.changed()  # nothing new to say: nothing sent
        await asyncio.sleep(notify.STATUS_EVERY_S + 0.05)
        assert len(sent) == 3

    asyncio.run(scenario())


def test_the_status_line_is_silent_outside_systemd() -> None:
    sent: list[str] = []
    line = notify.StatusLine(Notifier(None, sender=lambda m: sent.append(m) or True), lambda: "x")

    async def scenario() -> None:
        line.changed()
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert sent == []
