"""`vaccel run` and job control: Ctrl-Z / fg in a real pseudo-terminal, SIGSTOP/SIGCONT,
SIGTSTP sent to `vaccel run` alone, and the signal wait that must never act on garbage.

Python 3.11's `sigtimedwait` returns an uninitialised siginfo when a stop interrupts the
wait past its deadline; `vaccel run` once forwarded that garbage number to its command
and died with `OSError: [Errno 22]`. No timing is asserted: sleeps only set the scene,
waits have generous deadlines so a hang fails instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from vaccel.run import runner

from tests.conftest import Broker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux signals and /proc")


def _state(pid: int) -> str:
    """The process's state letter (T: stopped), or "gone" once it has exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    return stat[stat.rindex(")") + 2]


def _wait_for(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not met within {timeout}s")


# -- the wait itself ----------------------------------------------------------------------


def test_next_signal_drops_a_number_outside_the_waited_set(monkeypatch):
    """What an interrupted sigtimedwait handed back (si_signo 9804992 seen here) is never
    returned; the next real signal is."""
    garbage = signal.struct_siginfo((9804992, -2015456192, 0, 2, 0, -2015446720, 2))
    real = signal.struct_siginfo((int(signal.SIGUSR1), 0, 0, os.getpid(), os.getuid(), 0, 0))
    calls = iter([garbage, real])
    monkeypatch.setattr(runner.signal, "sigwaitinfo", lambda sigset: next(calls))
    assert runner.next_signal() == (signal.SIGUSR1, 0)


def test_a_stop_and_continue_during_the_wait_yields_only_real_signals(tmp_path: Path):
    """A process stopped and continued while it waits: every signal it then reports is one
    that was really sent (SIGCONT, then our SIGUSR1), never an uninitialised siginfo."""
    out = tmp_path / "seen"
    code = textwrap.dedent(f"""
        import signal, sys
        from vaccel.run import runner
        signal.pthread_sigmask(signal.SIG_BLOCK, runner._WAITED)
        print("ready", flush=True)
        seen = []
        while signal.SIGUSR1 not in seen:
            seen.append(runner.next_signal()[0])
        open({str(out)!r}, "w").write(" ".join(str(s) for s in seen))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # in the wait by now
        for _ in range(3):
            os.kill(proc.pid, signal.SIGSTOP)
            _wait_for(lambda: _state(proc.pid) == "T", what="stopped")
            time.sleep(0.3)  # longer than the 0.2 s timeout the old loop used
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGUSR1)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seen = [int(s) for s in out.read_text().split()]
    assert seen[-1] == signal.SIGUSR1
    assert set(seen) <= {signal.SIGCONT, signal.SIGUSR1}, seen


# -- vaccel run with a real command -----------------------------------------------------


def _run(broker: Broker, script: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--", "sh", "-c", script],
                            env=broker.env, **kwargs)


def test_sigstop_then_sigcont_leaves_the_command_running_to_its_exit_code(broker: Broker, tmp_path: Path):
    ready = tmp_path / "ready"
    run = _run(broker, f"touch {ready}; sleep 2; exit 7", stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready.exists, what="command started")
        for _ in range(3):
            os.kill(run.pid, signal.SIGSTOP)
            _wait_for(lambda: _state(run.pid) == "T", what="vaccel run stopped")
            time.sleep(0.5)
            os.kill(run.pid, signal.SIGCONT)
            time.sleep(0.1)
        _, err = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 7, err
    assert "Traceback" not in err and "Errno" not in err, err


def test_sigtstp_to_vaccel_run_alone_stops_and_sigcont_resumes_the_command(broker: Broker, tmp_path: Path):
    """`kill -TSTP` / `kill -CONT` sent to `vaccel run` only (not its process group)."""
    pidfile, go = tmp_path / "pid", tmp_path / "go"
    # The command runs until the test says `go`, however slow a loaded machine is.
    # A job of its own in this session, as a shell starts one. Left in pytest's group, the
    # kernel would discard the SIGTSTP forwarded to the command whenever that group is
    # orphaned (pytest started by setsid, or by a shell that has exited), as POSIX says.
    run = _run(broker, f"echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; "
                       f"while [ ! -e {go} ]; do sleep 0.05; done; exit 5", process_group=0)
    try:
        _wait_for(pidfile.exists, what="command started")
        child = int(pidfile.read_text())
        os.kill(run.pid, signal.SIGTSTP)
        _wait_for(lambda: _state(child) == "T" and _state(run.pid) == "T", what="both stopped")
        os.kill(run.pid, signal.SIGCONT)
        _wait_for(lambda: _state(child) != "T", what="the command resumed")
        go.touch()
        assert run.wait(30) == 5
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()


def _read_until(fd: int, pattern: str, seen: list[bytes], timeout: float = 30.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while True:
        text = b"".join(seen).decode(errors="replace")
        match = re.search(pattern, text)
        if match:
            return match
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {pattern!r} on the terminal within {timeout}s; it shows:\n{text}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                seen.append(os.read(fd, 4096))
            except OSError:  # EIO: the shell has gone
                raise AssertionError(f"the shell ended before {pattern!r}:\n{text}") from None


def test_ctrl_z_and_fg_in_a_real_terminal(broker: Broker):
    """An interactive bash on a pseudo-terminal: start the job, Ctrl-Z, fg; the job runs
    on to its own exit code and the shell shows it stopped in between."""
    env = {**broker.env, "PS1": "$ ", "TERM": "dumb", "PYTHONPATH": os.pathsep.join(sys.path)}
    pid, fd = pty.fork()
    if pid == 0:  # the child: a shell with job control on the new terminal
        os.execvpe("bash", ["bash", "--norc", "--noprofile", "-i"], env)
    seen: list[bytes] = []
    try:
        # Quoting splits the markers so the echoed command line does not match them.
        os.write(fd, f"{broker.python} -m vaccel.cli run -q -- sh -c "
                     "'echo st\"\"arted; sleep 2; echo fin\"\"ished; exit 7'\n".encode())
        _read_until(fd, r"started", seen)
        time.sleep(0.3)
        os.write(fd, b"\x1a")  # Ctrl-Z
        _read_until(fd, r"Stopped", seen)
        time.sleep(1.0)  # stopped well past any wait timeout
        os.write(fd, b"fg\n")
        _read_until(fd, r"finished", seen)
        os.write(fd, b"echo r\"\"c=$?\n")
        code = _read_until(fd, r"rc=(\d+)", seen).group(1)
        os.write(fd, b"exit\n")
    finally:
        os.close(fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    text = b"".join(seen).decode(errors="replace")
    assert code == "7", text
    assert "Traceback" not in text and "Errno" not in text, text


def test_a_lease_ended_behind_its_back_stops_the_command(broker: Broker, tmp_path: Path):
    """Released by someone else while the command runs: the heartbeat hears of it, the
    waiting main thread is woken and the command gets SIGTERM (its trap exits 9)."""
    ready = tmp_path / "ready"
    run = _run(broker, f"trap 'echo got TERM; exit 9' TERM; touch {ready}; while :; do sleep 0.1; done",
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(ready.exists, what="command started")
        devices = json.loads(broker.vaccel("status", "--json").stdout)["devices"]
        [lease_id] = {d["lease_id"] for d in devices if d["lease_id"]}
        assert broker.vaccel("release", lease_id).returncode == 0
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 9, err
    assert "got TERM" in out
    assert f"lease {lease_id} ended" in err and "stopping the command" in err
