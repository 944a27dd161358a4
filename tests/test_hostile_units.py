"""Unit tests of the mechanisms that keep a hostile local user bounded (issue 11,
docs/security.md): contract-file limits, the reservation rule, printable text, tokens of
dead processes, the state directory, the client's socket choice, log rate limiting, the
per-user work bound and the lease-end reaper's process selection."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from brokerd.base.journal import PrintableFilter, RateLimitFilter, log_event
from brokerd.base.process import Holder, Identity, ProcessId
from brokerd.base.procinfo import short_command, start_time
from brokerd.contract import ClientFacts, ContractError, Requirement, evaluate
from brokerd.contract.located import MAX_DEPTH
from brokerd.contract.spec import parse_runtime_spec
from brokerd.core.reaper import lease_processes, signal_all
from brokerd.devices.model import Device
from brokerd.edge.identity import TokenAuthority, TokenError, load_or_create_key
from brokerd.edge.work_guard import WorkGuard
from brokerd.leasing.errors import Busy
from brokerd.leasing.manager import LeaseManager
from brokerd.state.state_dir import UnsafeStateDir, check_state_dir, lock_state_dir, write_private
from tests.hostile_client import alias_bomb, large_legal_spec
from vaccel_common import paths
from vaccel_common.text import printable

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")


def _devices(count: int) -> list[Device]:
    return [Device(index=i, uuid=f"GPU-{i}", vendor="nvidia", name="A100", memory_mib=81920, backend="cuda")
            for i in range(count)]


# -- (1) and (8): contract files are bounded before anything is built -------------------


@pytest.mark.parametrize("text, words", [
    (alias_bomb(9), "aliases"),
    ("a: &x 1\n", "anchors"),
    ("[" * 100_000 + "]" * 100_000, "nest"),
    ("x:\n" + "".join("  " * i + "- \n" for i in range(1, MAX_DEPTH + 3)), f"deeper than {MAX_DEPTH}"),
    ("dependencies:\n  - name: a\0b\n", "NUL"),
    ("a: " + "x" * (300 * 1024), "larger than 256 KiB"),
    ("[" + "1," * 30_000 + "1]", "more than"),
])
def test_hostile_yaml_is_refused_as_a_contract_error_before_anything_is_built(text, words):
    with pytest.raises(ContractError, match=words):
        parse_runtime_spec(text)


def test_checking_dependencies_is_linear_in_the_spec_and_the_facts(monkeypatch):
    from brokerd.contract import checks

    calls = [0]
    normalise = checks._normalise

    def counted(name: str) -> str:
        calls[0] += 1
        return normalise(name)

    monkeypatch.setattr(checks, "_normalise", counted)
    spec = parse_runtime_spec(large_legal_spec(64))
    packages = {f"package-number-{i}": "2.0" for i in range(0, 3000, 2)}
    facts = ClientFacts(python_version="3.11.4", packages=packages)
    evaluate(Requirement(gpus=1, spec=spec, facts=facts), _devices(2))
    # Was deps x packages (seconds of CPU for a legal 175 KiB spec); now one pass over each.
    assert calls[0] <= len(spec.dependencies) + len(packages)


def test_a_large_legal_spec_still_parses():
    spec = parse_runtime_spec(large_legal_spec(64))
    assert len(spec.dependencies) > 500


def test_evaluation_is_remembered_for_the_same_devices_in_any_order():
    devices = _devices(3)
    requirement = Requirement(gpus=1)
    first = evaluate(requirement, devices)
    assert evaluate(requirement, list(reversed(devices))) is first
    assert evaluate(requirement, devices[:2]) is not first


# -- (2): per-user concurrency bound -----------------------------------------------------


def test_one_user_cannot_take_more_than_their_share_of_the_workers():
    async def main() -> tuple[int, int, bool]:
        guard = WorkGuard(workers=4, per_user=2, per_user_waiting=2)
        release = threading.Event()
        peak = [0]
        running = [0]
        lock = threading.Lock()

        def slow() -> None:
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            release.wait(5)
            with lock:
                running[0] -= 1

        flood = [asyncio.ensure_future(guard.run(1000, slow)) for _ in range(6)]
        await asyncio.sleep(0.2)
        refused = sum(1 for f in flood if f.done() and isinstance(f.exception(), Busy))
        other = await asyncio.wait_for(guard.run(2000, lambda: "served"), 2)  # another user is not stuck
        release.set()
        await asyncio.gather(*flood, return_exceptions=True)
        guard.close()
        return peak[0], refused, other == "served"

    peak, refused, served = asyncio.run(main())
    assert peak == 2 and refused == 2 and served


# -- (4): no head-of-line hogging ---------------------------------------------------------


def _holder(uid: int, pid: int) -> Holder:
    return Holder(uid, uid, pid, 1, f"user{uid}", "")


def test_a_request_blocked_by_its_own_users_lease_reserves_nothing():
    devices = _devices(2)
    manager = LeaseManager(devices)
    alice, bob = _holder(1001, 10), _holder(1002, 20)
    manager.submit(alice, Requirement(gpus=1), wait=False)
    queued = manager.submit(_holder(1001, 11), Requirement(gpus=2), wait=True)
    assert manager.waiting.blocked_by_own_leases(queued)
    granted = manager.submit(bob, Requirement(gpus=1), wait=False)  # old rule: Busy, gpu1 kept for alice
    assert granted.holder.uid == 1002
    manager.check_invariants()


def test_a_request_another_user_blocks_still_reserves_in_fifo_order():
    devices = _devices(2)
    manager = LeaseManager(devices)
    manager.submit(_holder(1001, 10), Requirement(gpus=1), wait=False)
    queued = manager.submit(_holder(1002, 20), Requirement(gpus=2), wait=True)
    assert not manager.waiting.blocked_by_own_leases(queued)
    with pytest.raises(Busy):
        manager.submit(_holder(1003, 30), Requirement(gpus=1), wait=False)


# -- (5): printable text ------------------------------------------------------------------


def test_printable_escapes_control_bytes_visibly():
    assert printable("train.py --lr 3e-4") == "train.py --lr 3e-4"
    assert printable("\x1b[2Jx\ny\u202e") == "\\x1b[2Jx\\x0ay\\u202e"
    # /proc's text is kept exact (--json shows it so) and escaped where it is shown.
    assert short_command(["/usr/bin/\x1b]0;t\x07evil", "a\nb"]) == "\x1b]0;t\x07evil a\nb"


def test_the_cli_text_output_escapes_what_others_set():
    from vaccel.cli import common as cli

    from vaccel_common.status_text import table as text_table

    table = text_table([["l-1", "mallory", "\x1b]0;t\x07evil a\nb"]], ["LEASE", "USER", "COMMAND"])
    assert table.splitlines()[1] == "l-1    mallory  \\x1b]0;t\\x07evil a\\x0ab"
    assert cli.shown("queue:\n  1. bob \x1b[2J") == "queue:\n  1. bob \\x1b[2J"


def test_log_lines_cannot_be_forged(caplog):
    caplog.set_level(logging.INFO, logger="vaccel.brokerd")
    log_event("refuse", "missing evil\n2026-01-01 INFO grant lease=l-X user=root", user="a\nb", dep="x\ry")
    (record,) = caplog.records
    assert "\n" not in record.getMessage() and "\r" not in record.getMessage()
    other = logging.LogRecord("x", logging.ERROR, __file__, 1, "bad %s", ("a\nb\x1b",), None)
    PrintableFilter().filter(other)
    assert other.getMessage() == "bad a\\x0ab\\x1b"


def test_repeated_failures_are_rate_limited():
    now = [0.0]
    limit = RateLimitFilter(burst=3, window_s=10, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                                 None, None)

    passed = sum(limit.filter(record()) for _ in range(1000))
    assert passed == 3
    now[0] = 11.0
    summary = record()
    assert limit.filter(summary) and "997 similar lines left out" in summary.getMessage()


# -- (7): a dead process's token ----------------------------------------------------------


def test_a_token_of_an_exited_process_is_refused_even_after_pid_reuse():
    started = {4242: 100}
    authority = TokenAuthority(b"k" * 32, 60, started_at=started.get)
    token, _ = authority.mint(Identity(1000, 1000, 4242, 100))
    assert authority.verify(token).pid == 4242
    started[4242] = 555  # exited; another process now has the pid
    with pytest.raises(TokenError, match="exited"):
        authority.verify(token)
    del started[4242]
    with pytest.raises(TokenError, match="exited"):
        authority.verify(token)


def test_a_real_exited_process_token_is_refused():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = start_time(child.pid)
    authority = TokenAuthority(b"k" * 32, 60)
    token, _ = authority.mint(Identity(os.getuid(), os.getgid(), child.pid, start))
    child.wait()
    with pytest.raises(TokenError):
        authority.verify(token)


# -- (6): the state directory and the client's socket choice ------------------------------


def test_state_dir_writable_by_others_or_holding_a_symlink_is_refused(tmp_path):
    state = tmp_path / "state"
    check_state_dir(state)
    os.chmod(state, 0o777)
    with pytest.raises(UnsafeStateDir, match="writable by others"):
        check_state_dir(state)
    os.chmod(state, 0o700)
    (state / "token.key").symlink_to(tmp_path / "planted")
    with pytest.raises(UnsafeStateDir, match=r"token\.key is a symlink"):
        lock_state_dir(state)


def test_the_key_is_never_written_through_a_planted_link(tmp_path):
    state = tmp_path / "state"
    check_state_dir(state)
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (state / "token.key.tmp").symlink_to(victim)
    write_private(state / "token.key", b"k" * 32)
    assert victim.read_text() == "untouched"
    assert load_or_create_key(state) == b"k" * 32


@ROOT_ONLY
def test_state_dir_of_another_user_is_refused(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)
    with pytest.raises(UnsafeStateDir, match="belongs to uid 65534"):
        check_state_dir(state)


@ROOT_ONLY
def test_a_squatted_personal_socket_folder_makes_the_client_use_the_system_broker(tmp_path, monkeypatch):
    uid = 54321
    squat = Path(f"/tmp/vaccel-{uid}")
    system = tmp_path / "brokerd.sock"
    system.touch()
    squat.mkdir(exist_ok=True)
    try:
        (squat / "brokerd.sock").touch()
        os.chown(squat, 65534, 65534)  # someone else made it first
        monkeypatch.setattr(paths, "SYSTEM_SOCKET", system)
        monkeypatch.setattr(paths.os, "getuid", lambda: uid)
        monkeypatch.delenv("VACCEL_SOCKET", raising=False)
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        assert paths.client_socket() == str(system)
        os.chown(squat, uid, uid)  # the user's own folder is used as before
        assert paths.client_socket() == str(squat / "brokerd.sock")
    finally:
        (squat / "brokerd.sock").unlink(missing_ok=True)
        squat.rmdir()


# -- (9): which processes a lease end stops -----------------------------------------------


def test_lease_processes_are_the_roots_and_their_descendants_of_the_holders_uid():
    tree = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        found: list[ProcessId] = []
        while time.monotonic() < deadline and len(found) < 2:
            found = lease_processes([ProcessId(tree.pid, start_time(tree.pid))], os.getuid())
            time.sleep(0.05)
        assert found[0].pid == tree.pid and len(found) == 2
        assert lease_processes([ProcessId(tree.pid, 1)], os.getuid()) == []  # a reused pid is not it
        assert lease_processes([ProcessId(os.getpid(), start_time(os.getpid()))], os.getuid()) == [], \
            "the daemon and its ancestors are never stopped"
        assert lease_processes(found, os.getuid() + 1) == []  # other users' processes are not touched
        assert signal_all(found, 15) == found
        assert tree.wait(5) != 0
    finally:
        tree.kill()
        tree.wait()


@ROOT_ONLY
def test_the_daemon_refuses_a_state_dir_someone_else_controls_with_one_clear_line(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)
    r = subprocess.run([sys.executable, "-m", "brokerd", "--state-dir", str(state), "--socket",
                        str(tmp_path / "b.sock"), "--inventory", str(Path(__file__).parent.parent / "examples" /
                                                                      "lab-server.yaml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "refusing the state directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
