"""Daemon logging: plain stderr lines, the journal's structured fields, the auto choice."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator

import pytest

from brokerd.base import journal
from brokerd.base.journal import log_event, setup_logging


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


class Stderr:
    """What the code under test wrote to sys.stderr (pytest swaps it in per test)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self._capsys = capsys
        self._seen = ""

    def getvalue(self) -> str:
        self._seen += self._capsys.readouterr().err
        return self._seen


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Stderr:
    return Stderr(capsys)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(journal, "_journal_sendv", lambda: lambda *lines: calls.append(lines))
    return calls


def test_plain_line_on_stderr(stderr: Stderr) -> None:
    setup_logging("info", journal=False)
    log_event("grant", "first free device", lease_id="L-1", user="alice",
              device_uuids=["GPU-a", "GPU-b"], pid=4242)
    line = stderr.getvalue()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO grant lease=L-1 user=alice "
        r"devices=GPU-a,GPU-b pid=4242: first free device\n", line), line


def test_level_filters_and_refusals_can_be_warnings(stderr: Stderr) -> None:
    setup_logging("warning", journal=False)
    log_event("release", "holder released it", lease_id="L-1")
    log_event("refuse", "asked for 9 GPUs, 4 exist", user="bob", level=logging.WARNING)
    assert stderr.getvalue().count("\n") == 1
    assert " WARNING refuse user=bob: asked for 9 GPUs, 4 exist" in stderr.getvalue()


def test_setup_twice_replaces_its_own_handler(stderr: Stderr) -> None:
    setup_logging("info", journal=False)
    setup_logging("debug", journal=False)
    log_event("expire", "heartbeat missed for 30s", lease_id="L-2")
    assert stderr.getvalue().count("expire lease=L-2") == 1
    assert logging.getLogger().level == logging.DEBUG


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="log level"):
        setup_logging("loud")


def test_journal_fields(sent: list[tuple[str, ...]]) -> None:
    setup_logging("info", journal=True)
    log_event("grant", "first free device", lease_id="L-1", user="alice",
              device_uuids=["GPU-a", "GPU-b"], pid=4242)
    assert len(sent) == 1
    lines = sent[0]
    assert "MESSAGE=grant lease=L-1 user=alice devices=GPU-a,GPU-b pid=4242: first free device" \
        in lines
    for field in ("EVENT=grant", "LEASE_ID=L-1", "USER=alice", "DEVICE_UUID=GPU-a",
                  "DEVICE_UUID=GPU-b", "PID=4242", "PRIORITY=6",
                  "SYSLOG_IDENTIFIER=vaccel-brokerd", "LOGGER=vaccel.brokerd"):
        assert field in lines, field


def test_an_event_names_the_code_that_logged_it(sent: list[tuple[str, ...]]) -> None:
    # CODE_FILE/CODE_LINE/CODE_FUNC point an admin at the code behind a journal entry:
    # the caller of log_event, not log_event itself (which every event would name).
    setup_logging("info", journal=True)
    log_event("grant", "first free device", lease_id="L-1")
    (lines,) = sent
    assert f"CODE_FILE={__file__}" in lines, lines
    assert "CODE_FUNC=test_an_event_names_the_code_that_logged_it" in lines, lines


def test_plain_records_reach_the_journal_without_event_fields(
        sent: list[tuple[str, ...]]) -> None:
    setup_logging("info", journal=True)
    logging.getLogger("brokerd.state.store").error("state file is damaged")
    (lines,) = sent
    assert "MESSAGE=state file is damaged" in lines
    assert "PRIORITY=3" in lines
    assert not any(line.startswith("EVENT=") for line in lines)


def test_journal_without_systemd_python_uses_priority_prefixes(
        stderr: Stderr, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal, "_journal_sendv", lambda: None)
    setup_logging("info", journal=True)
    log_event("revoke", "admin revoked it", lease_id="L-3", level=logging.WARNING)
    assert stderr.getvalue() == "<4>revoke lease=L-3: admin revoked it\n"


def test_auto_detects_the_journal_from_journal_stream(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch,
        sent: list[tuple[str, ...]]) -> None:
    with open(os.path.join(tmp_path, "stderr"), "w") as fake_stderr:
        monkeypatch.setattr(sys, "stderr", fake_stderr)
        st = os.fstat(fake_stderr.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert journal.stderr_is_journal()
        setup_logging("info")
        log_event("grant", "auto", lease_id="L-4")
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
        assert not journal.stderr_is_journal()
    assert any("LEASE_ID=L-4" in lines for lines in sent)


def test_auto_is_plain_without_journal_stream(stderr: Stderr,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    setup_logging("info")
    log_event("release", "done", lease_id="L-5")
    assert " INFO release lease=L-5: done" in stderr.getvalue()


def test_an_answer_whose_caller_left_is_one_line_not_a_traceback(stderr: Stderr) -> None:
    """gRPC logs an answer it could not send (the caller gave up: a Report with a short
    deadline) as an ERROR with the core's traceback; a caller that leaves is not the
    daemon's fault (docs/security.md, "A caller that leaves never hurts a worker")."""
    setup_logging("info", journal=False)

    class ExecuteBatchError(Exception):  # grpc._cython.cygrpc's, by name
        pass

    try:
        raise ExecuteBatchError('Failed "execute_batch"')
    except ExecuteBatchError:
        logging.getLogger("grpc._cython.cygrpc").exception(
            "ExecuteBatchError raised in core by servicer method [/vaccel.v1.Broker/Report]")
    try:
        raise ValueError("ours")
    except ValueError:
        logging.getLogger("vaccel.brokerd").exception("a fault of ours keeps its traceback")
    text = stderr.getvalue()
    assert " INFO grpc: the caller of /vaccel.v1.Broker/Report left before its answer was sent" in text, text
    assert text.count("Traceback") == 1 and "ValueError: ours" in text


def test_answers_whose_callers_left_are_rate_limited_like_warnings(stderr: Stderr) -> None:
    """A user whose calls leave on purpose, a thousand a second, wrote a line each (issue 43):
    the caller-left line is info, but under the same rate limit as warnings."""
    setup_logging("info", journal=False)

    class ExecuteBatchError(Exception):  # grpc._cython.cygrpc's, by name
        pass

    for _ in range(50):
        try:
            raise ExecuteBatchError('Failed "execute_batch"')
        except ExecuteBatchError:
            logging.getLogger("grpc._cython.cygrpc").exception(
                "ExecuteBatchError raised in core by servicer method [/vaccel.v1.Broker/Status]")
    for i in range(3):
        log_event("grant", "granted", lease_id=f"L-{i}")  # lease events keep every line
    text = stderr.getvalue()
    assert text.count("the caller of /vaccel.v1.Broker/Status left before its answer was sent") == 5, text
    assert text.count(" INFO grant lease=L-") == 3, text
