"""The systemd notify protocol (sd_notify): READY, RELOADING, STOPPING, STATUS, WATCHDOG.

Under `Type=notify` systemd waits for READY=1 before it calls the service started, shows
the last STATUS= line in `systemctl status`, and restarts the service when WATCHDOG=1
pings stop for longer than WatchdogSec. Outside systemd (no NOTIFY_SOCKET) every method is
a no-op, and no method ever raises: a broken notify socket must not take the broker down.

systemd-python's `systemd.daemon.notify` is used when it is importable; otherwise the
protocol is a single datagram on an AF_UNIX socket, which is a few lines of our own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable

log = logging.getLogger("vaccel.brokerd")


def _systemd_sender() -> Callable[[str], bool] | None:
    try:
        from systemd import daemon
    except ImportError:
        return None
    return daemon.notify


def _socket_address(name: str) -> str | bytes:
    # A leading '@' names a socket in the abstract namespace: the kernel wants a NUL there.
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


class Notifier:
    """Sends sd_notify messages to the socket systemd gave us, or does nothing."""

    def __init__(
        self,
        socket_path: str | None,
        *,
        watchdog_usec: int | None = None,
        sender: Callable[[str], bool] | None = None,
    ) -> None:
        self._address = _socket_address(socket_path) if socket_path else None
        self._watchdog_usec = watchdog_usec
        self._sender = sender
        self._warned = False

    @classmethod
    def from_env(cls) -> Notifier:
        """A notifier for the environment systemd set up (NOTIFY_SOCKET, WATCHDOG_USEC)."""
        path = os.environ.get("NOTIFY_SOCKET") or None
        return cls(path, watchdog_usec=_watchdog_usec_from_env(),
                   sender=_systemd_sender() if path else None)

    @property
    def enabled(self) -> bool:
        """True when a notify socket is configured (we run under systemd Type=notify)."""
        return self._address is not None

    def ready(self) -> None:
        """The socket listens and the state is restored: systemd may call us started."""
        self._send("READY=1")

    def reloading(self) -> None:
        """A reload (SIGHUP) began; follow with ready() when the new config is in force."""
        # MONOTONIC_USEC lets systemd tell this reload apart from an earlier one.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self._send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> None:
        """Shutdown began; systemd shows the unit as deactivating."""
        self._send("STOPPING=1")

    def status(self, text: str) -> None:
        """One line for `systemctl status`, e.g. "3/4 GPUs leased, 2 waiting, 0 unhealthy"."""
        self._send("STATUS=" + " ".join(text.splitlines()))

    def watchdog(self) -> None:
        """Keep-alive ping; call it from the event loop itself so a hung loop stops it."""
        self._send("WATCHDOG=1")

    def watchdog_interval_s(self) -> float | None:
        """How often to ping (half of WatchdogSec), or None when no watchdog is asked for."""
        if not self._watchdog_usec:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def _send(self, message: str) -> None:
        if self._address is None:
            return
        try:
            if self._sender is not None:
                self._sender(message)
                return
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message.encode(), self._address)
        except OSError as exc:
            # Warn once: a notify socket that went away must not flood the log either.
            if not self._warned:
                self._warned = True
                log.warning("cannot notify systemd (%s): %s", message.split("=", 1)[0], exc)


STATUS_EVERY_S = 0.5  # the most often `systemctl status`'s line changes


class StatusLine:
    """The STATUS= line kept true without a datagram per change: every grant and release
    is a change, and under load one datagram each woke PID 1 ~2,000 times a second (and a
    notify socket whose reader lagged, ten datagrams deep, blocked our event loop). A
    change after a quiet spell is sent at once; changes closer together than
    STATUS_EVERY_S make one line at the end of that time, with the state then."""

    def __init__(self, notifier: Notifier, summary: Callable[[], str]) -> None:
        self._notifier = notifier
        self._summary = summary
        self._sent_at = -STATUS_EVERY_S
        self._due: asyncio.TimerHandle | None = None
        self._last = ""

    def changed(self) -> None:
        """The state changed: see that the line says so within STATUS_EVERY_S."""
        if not self._notifier.enabled or self._due is not None:
            return
        loop = asyncio.get_running_loop()
        wait = self._sent_at + STATUS_EVERY_S - loop.time()
        if wait <= 0:
            self.send(only_if_new=True)
        else:
            self._due = loop.call_later(wait, self.send, True)

    def send(self, only_if_new: bool = False) -> None:
        """The line now: at start-up and after a reload (READY=1 again) always, when a
        change is due only if it says something new."""
        if self._due is not None:
            self._due.cancel()
            self._due = None
        text = self._summary()
        with contextlib.suppress(RuntimeError):  # no running loop: nothing is ever due then
            self._sent_at = asyncio.get_running_loop().time()
        if not only_if_new or text != self._last:
            self._last = text
            self._notifier.status(text)


def _watchdog_usec_from_env() -> int | None:
    # WATCHDOG_PID names the process the watchdog is meant for; a child that inherited
    # the environment must not ping on its parent's behalf.
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec if usec > 0 else None
