"""A plain `vaccel run` at the interpreter's floor (issue 36, part 3): vaccel/run/quick_run.py
asks for a ready-made grant (brokerd/edge/views.py), runs the command, and releases, or
hands a longer command to the runner. The user must not be able to tell which path ran:
each test runs the entry point (vaccel/entry.py) and the full CLI and compares what they
say and how they exit (lease ids aside: each run gets its own)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import Broker, alive
from tests.test_multiuser import as_user, root_broker, staged, wait_for  # noqa: F401 - fixtures, used by name

ENTRY = [sys.executable, "-m", "vaccel.entry"]
FULL = [sys.executable, "-m", "vaccel.cli"]
# What a quick `vaccel run` may import beyond the interpreter's start (vaccel/run/quick_run.py's docstring).
# The packages vaccel.run and vaccel.session are docstrings only (their __init__ imports nothing).
JUSTIFIED = {"vaccel", "vaccel.run", "vaccel.run.quick_run", "vaccel.run.forked", "vaccel.session",
             "vaccel.session.identity_calls", "vaccel.run.command_path",
             "vaccel_common", "vaccel_common.paths", "vaccel_common.side_call", "_socket", "__future__",
             "ctypes", "_ctypes", "ctypes._endian", "struct", "_struct", "types"}  # ctypes and what it imports


def _same_ids(text: str) -> str:
    return re.sub(r"\bl-[0-9a-f]{12}\b", "l-ID", text)


def both(argv: list[str], env: dict[str, str], cwd: str = "/") -> tuple[tuple, tuple]:
    results = []
    for cli in (ENTRY, FULL):
        done = subprocess.run([*cli, *argv], env=env, capture_output=True, text=True, timeout=60, cwd=cwd)
        results.append((done.returncode, _same_ids(done.stdout), _same_ids(done.stderr)))
    return results[0], results[1]


def test_the_wire_and_the_names_are_the_full_clients():
    from vaccel.cli import full as cli
    from vaccel.contract import files as contract_files
    from vaccel.run import quick_run, runner
    from vaccel.session.lease_session import LeaseRequest

    from vaccel_common.side_call import acquire_request, release_request
    from vaccel_common.v1 import broker_pb2 as pb

    for gpus, command in ((1, ["true"]), (3, ["python", "-c", "print('é' * 300)"]), (2, [""])):
        wire, _ = LeaseRequest(gpus=gpus, wait=True, command=" ".join(command)).build("/")
        wire.request_key = "k" * 24
        assert acquire_request(gpus, " ".join(command), "k" * 24) == wire.SerializeToString()
    assert release_request("l-0123456789ab") == pb.ReleaseRequest(lease_id="l-0123456789ab").SerializeToString()
    assert quick_run.ENGINE_PROGRAMS == cli._ENGINE_PROGRAMS
    assert quick_run.CONTRACT_FILES == (contract_files.DEFAULT_SPEC, contract_files.DEFAULT_CONFIG)
    assert quick_run.WAITED == {int(s) for s in runner._WAITED}


@pytest.mark.parametrize(("argv", "read"), [
    (["run", "--", "true"], (None, False, 1, ["true"])),
    (["--socket", "/s", "run", "-q", "--gpus", "2", "sh", "-c", "x"], ("/s", True, 2, ["sh", "-c", "x"])),
    (["run", "--gpus=3", "--socket=/s", "--", "--", "x"], ("/s", False, 3, ["--", "x"])),
    (["run", "--no-wait", "--", "true"], None), (["run", "--gpus", "0", "--", "true"], None),
    (["run", "--time", "1h", "--", "true"], None), (["run", "--gpu", "1", "--", "true"], None),
    (["run", "--"], None), (["run", "--help"], None), (["status"], None), (["--gpus", "1", "run", "true"], None),
])
def test_what_the_quick_path_reads(argv: list[str], read: tuple | None):
    from vaccel.run.quick_run import run_asked

    assert run_asked(argv) == read


def test_a_quick_run_says_and_exits_as_the_full_runner(broker: Broker):
    env = {**broker.env, "CUDA_VISIBLE_DEVICES": "not-the-lease's"}
    show = "echo $CUDA_VISIBLE_DEVICES $VACCEL_LEASE_ID $VACCEL_DEVICES"
    for argv in (["run", "--", "true"], ["run", "-q", "--gpus", "2", "--", "sh", "-c", f"{show}; exit 3"],
                 ["run", "--", "sh", "-c", "kill -TERM $$"],
                 [f"--socket={broker.socket}", "run", "--", "sh", "-c", show],
                 ["run", "--", "/nonexistent"], ["run", "--gpus", "5", "--", "true"]):
        entry, full = both(argv, env)
        assert entry == full, argv
    code, out, err = entry
    assert code == 1 and "this host has only 4" in err  # the refusal, said once
    code, out, err = both(["run", "-q", "--", "sh", "-c", show], env)[0]
    assert code == 0 and "not-the-lease's" not in out and out.split()[1] == "l-ID", out


def test_a_command_that_outlives_the_quick_path_is_kept_by_the_runner(broker: Broker):
    """The broker's heartbeat_ttl is 3 s here: a 4 s command lives on heartbeats."""
    entry, full = both(["run", "--", "sh", "-c", "sleep 4; exit 4"], broker.env)
    assert entry == full
    assert entry[0] == 4 and entry[2].endswith("released\n"), entry


def test_a_signal_reaches_the_command_on_either_path(broker: Broker):
    trap = 'trap "exit 7" TERM; echo up; while :; do sleep 0.01; done'
    for delay in (0.0, 0.5):  # within the quick path, and after the hand-over
        run = subprocess.Popen([*ENTRY, "run", "-q", "--", "sh", "-c", trap], env=broker.env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        assert run.stdout.readline() == "up\n"
        time.sleep(delay)
        run.send_signal(signal.SIGTERM)
        assert run.wait(30) == 7, run.stderr.read()


def test_a_killed_quick_run_frees_its_gpu_and_takes_its_command_along(broker: Broker):
    run = subprocess.Popen([*ENTRY, "run", "-q", "--gpus", "4", "--", "sh", "-c", "echo $$; exec sleep 60"],
                           env=broker.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    command_pid = int(run.stdout.readline())
    run.kill()  # at once: most likely still on the quick path
    run.wait(10)
    wait_for(lambda: not alive(command_pid))
    wait_for(lambda: "leased" not in broker.vaccel("status").stdout)


def test_what_the_quick_path_does_not_run_the_full_runner_does(broker: Broker, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    from vaccel.run import quick_run

    # A request that must wait: the quick path is told so (nothing queued) and the full CLI waits in line.
    holder = subprocess.Popen([*FULL, "run", "-q", "--gpus", "4", "--", "sleep", "2"], env=broker.env,
                              stderr=subprocess.PIPE, text=True)
    assert "lease l-" in holder.stderr.readline()
    waiter = subprocess.run([*ENTRY, "run", "--", "true"], env=broker.env, capture_output=True, text=True,
                            timeout=60)
    holder.wait(10)
    assert waiter.returncode == 0 and "waiting" in waiter.stderr and waiter.stderr.endswith("released\n"), \
        waiter.stderr
    # A contract file here, a lease around us, a container engine: each is the full runner's.
    monkeypatch.chdir("/")
    assert quick_run._plain(["true"])
    assert not quick_run._plain(["docker", "run", "x"])
    monkeypatch.setenv("VACCEL_LEASE_ID", "l-0123456789ab")
    assert not quick_run._plain(["true"])
    monkeypatch.delenv("VACCEL_LEASE_ID")
    (tmp_path / "runtime-spec.yaml").write_text("dependencies: []\n")
    monkeypatch.chdir(tmp_path)
    assert not quick_run._plain(["true"])
    entry, full = both(["run", "--", "true"], broker.env, cwd=str(tmp_path))
    assert entry == full and "runtime-spec.yaml" in entry[2]


def test_a_quick_run_imports_only_what_it_needs(broker: Broker):
    code = f"""
import sys
before = set(sys.modules)
from vaccel.run import quick_run
rc = quick_run.run(["run", "-q", "--", "true"])
print(rc, sorted(set(sys.modules) - before - {JUSTIFIED!r}))
"""
    done = subprocess.run([sys.executable, "-c", code], env=broker.env, capture_output=True, text=True, timeout=60,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 []"


@pytest.mark.multiuser
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create users")
def test_a_quick_run_holds_the_lease_as_its_caller(root_broker: Broker, staged: Path):  # noqa: F811
    env = {"PATH": "/usr/bin:/bin", "VACCEL_SOCKET": str(root_broker.socket), "PYTHONPATH": str(staged), "HOME": "/"}
    run = subprocess.Popen([*ENTRY, "run", "--", "sh", "-c", "echo $VACCEL_LEASE_ID; sleep 1"], user="vaccel-bob",
                           env=env, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lease_id = run.stdout.readline().strip()
    leases = as_user(root_broker, staged, "vaccel-bob", "leases", "--json")
    assert lease_id in leases.stdout and '"vaccel-bob"' in leases.stdout
    assert run.wait(30) == 0
    assert run.stderr.read().endswith(f"lease {lease_id} released\n")
