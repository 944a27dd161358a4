"""Logging for the daemon: structured journal entries under systemd, plain lines elsewhere.

Every lease event (grant, release, expiry, revoke, refusal) is one `log_event` call, which
is one line saying who, what and why. Under systemd the same line goes to the journal with
fields an admin can filter on:

    journalctl -u vaccel-brokerd EVENT=grant USER=alice
    journalctl -u vaccel-brokerd DEVICE_UUID=GPU-6f1a0c2e-...

A lease over several devices carries one DEVICE_UUID field per device (the journal allows
repeated fields), so the filter above finds it whichever device is asked for.

Two filters sit on every handler this module installs: each line is made printable (a
dependency name or a command from a client can hold a newline and a forged "grant ..."
line after it; vaccel_common/text.py escapes it), and a message repeated in a burst (EMFILE on
accept, a client's mistake logged with a traceback) is written a few times per minute,
then counted, never thousands of times a second.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

from vaccel_common.text import printable

LOGGER_NAME = "vaccel.brokerd"
SYSLOG_IDENTIFIER = "vaccel-brokerd"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO,
           "warning": logging.WARNING, "error": logging.ERROR}
# The `extra=` key under which log_event hands its journal fields to the handler.
_FIELDS_ATTR = "vaccel_journal_fields"

log = logging.getLogger(LOGGER_NAME)


def stderr_is_journal() -> bool:
    """True when systemd connected our stderr to the journal (JOURNAL_STREAM names it)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


def _journal_sendv() -> Callable[..., None] | None:
    try:
        from systemd import journal
    except ImportError:
        return None
    return journal.sendv


def _syslog_priority(levelno: int) -> int:
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


class JournalFieldsHandler(logging.Handler):
    """Sends records to journald natively, with log_event's fields attached.

    Built on `systemd.journal.sendv` rather than `JournalHandler` because a lease over
    several devices needs the DEVICE_UUID field repeated, which a keyword call cannot say.
    """

    def __init__(self, sendv: Callable[..., None], level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self._sendv = sendv

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = [
                f"MESSAGE={self.format(record)}",
                f"PRIORITY={_syslog_priority(record.levelno)}",
                f"SYSLOG_IDENTIFIER={SYSLOG_IDENTIFIER}",
                f"LOGGER={record.name}",
                f"CODE_FILE={record.pathname}",
                f"CODE_LINE={record.lineno}",
                f"CODE_FUNC={record.funcName}",
            ]
            lines += [f"{key}={value}" for key, value in getattr(record, _FIELDS_ATTR, ())]
            self._sendv(*lines)
        except (OSError, ValueError):
            self.handleError(record)


class _PriorityPrefixFormatter(logging.Formatter):
    """`<6>message`: journald reads the level from the prefix and stamps the time itself."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{_syslog_priority(record.levelno)}>{super().format(record)}"


class PrintableFilter(logging.Filter):
    """Escape what is not printable in the record's message (the traceback, which is the
    daemon's own text, is left alone)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = printable(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True


class CallerGoneFilter(logging.Filter):
    """gRPC logs an answer it could not send because its caller had left (a deadline, a
    closed connection) as an ERROR with the core's traceback: `ExecuteBatchError raised in
    core by servicer method [/vaccel.v1.Broker/Report]`. A caller that leaves is not a
    fault of the daemon's: one INFO line naming the method instead, under the rate limit
    all the same (a caller that leaves on purpose, a thousand times a second, issue 43)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("grpc") and record.exc_info and record.exc_info[0] is not None \
                and record.exc_info[0].__name__ == "ExecuteBatchError":
            method = record.getMessage().rpartition("[")[2].rstrip("]") or "a call"
            record.msg, record.args = f"grpc: the caller of {method} left before its answer was sent", None
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.rate_limited = True
            return logging.getLogger().isEnabledFor(logging.INFO)
        return True


class RateLimitFilter(logging.Filter):
    """At most `burst` records per `window_s` for one (logger, level, message template);
    the first record after a quiet window says how many were left out."""

    def __init__(self, burst: int = 5, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst, self.window_s, self._clock = burst, window_s, clock
        self._seen: dict[tuple[str, int, str], list[float]] = {}  # key -> [window start, count, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING and not getattr(record, "rate_limited", False):
            return True  # lease events are info: each one is wanted, and each is bounded by a request
        key = (record.name, record.levelno, str(record.msg)[:200])
        now = self._clock()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window_s:
            dropped = int(entry[2]) if entry else 0
            if len(self._seen) > 1000:
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.getMessage()} ({dropped} similar lines left out in the last " \
                             f"{self.window_s:.0f}s)"
                record.args = None
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        entry[2] += 1
        return False


def setup_logging(level: str = "info", *, journal: bool | None = None) -> None:
    """Route the daemon's logging: journal=None picks the journal when stderr is the journal.

    With journal=True (or auto under systemd) and systemd-python importable, records go to
    journald natively with structured fields. Under systemd without systemd-python, lines
    on stderr carry a `<N>` priority prefix that journald understands. Elsewhere, lines on
    stderr look like `2026-11-30 10:02:03 INFO grant lease=... user=alice: ...`.
    Calling it again (SIGHUP with a new log level) replaces what an earlier call set up.
    """
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {', '.join(_LEVELS)}, not {level!r}")
    under_journal = stderr_is_journal() if journal is None else journal
    sendv = _journal_sendv() if under_journal else None
    handler: logging.Handler
    if sendv is not None:
        handler = JournalFieldsHandler(sendv)
        handler.setFormatter(logging.Formatter("%(message)s"))
    elif under_journal:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_PriorityPrefixFormatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                               datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_vaccel_owned", False)]:
        root.removeHandler(old)
        old.close()
    handler._vaccel_owned = True  # type: ignore[attr-defined]
    handler.addFilter(CallerGoneFilter())
    handler.addFilter(RateLimitFilter())
    handler.addFilter(PrintableFilter())
    root.addHandler(handler)
    root.setLevel(_LEVELS[level])


def log_event(
    event: str,
    message: str,
    *,
    lease_id: str = "",
    user: str = "",
    device_uuids: Sequence[str] = (),
    level: int = logging.INFO,
    **fields: object,
) -> None:
    """Log one lease event as one line: `grant lease=L user=alice devices=GPU-a: why`.

    In the journal the line carries EVENT, LEASE_ID, USER, one DEVICE_UUID per device and
    every extra keyword upper-cased (pid=123 -> PID=123).
    """
    message, user = printable(message), printable(user)
    parts = [event]
    journal_fields: list[tuple[str, object]] = [("EVENT", event)]
    if lease_id:
        parts.append(f"lease={lease_id}")
        journal_fields.append(("LEASE_ID", lease_id))
    if user:
        parts.append(f"user={user}")
        journal_fields.append(("USER", user))
    if device_uuids:
        parts.append("devices=" + ",".join(device_uuids))
        journal_fields += [("DEVICE_UUID", uuid) for uuid in device_uuids]
    for key, value in fields.items():
        value = printable(str(value))
        parts.append(f"{key}={value}")
        journal_fields.append((key.upper(), value))
    text = " ".join(parts) + (f": {message}" if message else "")
    # stacklevel=2: the journal's CODE_FILE/LINE/FUNC name our caller, not this function.
    log.log(level, "%s", text, extra={_FIELDS_ATTR: journal_fields}, stacklevel=2)
