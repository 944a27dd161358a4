"""`vaccel status` answered ready-made (issue 36, part 3): the broker renders the text and
the JSON for its caller (brokerd/edge/views.py), the entry point (vaccel/entry.py)
prints them without importing argparse, protobuf or grpc, and the full CLI answers
everything else. What the user sees must not depend on which path answered: each test
runs both and compares bytes, as root, as another real Unix user, with the client in
another time zone than the broker, and while a hostile user floods the identity socket.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Broker
from tests.test_multiuser import alice_holds_a_gpu, root_broker, staged  # noqa: F401 - fixtures, used by name

ENTRY = [sys.executable, "-m", "vaccel.entry"]
FULL = [sys.executable, "-m", "vaccel.cli"]
# A zone half an hour off the hour, and not the broker's (it runs in UTC here): a clock the
# broker rendered in its own zone shows at once.
CLIENT_TZ = "Asia/Kolkata"
# What a ready-made status may import beyond the interpreter's own start (vaccel/entry.py's docstring).
# vaccel.session is its package's docstring only (its __init__ imports nothing).
JUSTIFIED = {"vaccel", "vaccel.entry", "vaccel.session", "vaccel.session.identity_calls", "vaccel_common",
             "vaccel_common.paths",
             "vaccel_common.side_call", "_socket", "__future__"}


def both(argv: list[str], env: dict[str, str], user: str | None = None) -> tuple[tuple, tuple]:
    """(exit, stdout, stderr) of the entry point and of the full CLI, run back to back."""
    results = []
    for cli in (ENTRY, FULL):
        done = subprocess.run([*cli, *argv], env=env, capture_output=True, text=True, timeout=60, user=user, cwd="/")
        results.append((done.returncode, done.stdout, done.stderr))
    return results[0], results[1]


def same_output(argv: list[str], env: dict[str, str], user: str | None = None) -> tuple:
    """Both paths' output, which must be byte for byte the same. A status shows durations
    to the second ("3s ago"), so two runs a moment apart may straddle a second: a few
    tries, each pair run back to back; a real difference shows in every one."""
    for _ in range(5):
        entry, full = both(argv, env, user)
        if entry == full:
            return entry
    assert entry == full
    return entry


@pytest.fixture
def held(broker: Broker) -> Iterator[Broker]:
    """The lab broker with two GPUs leased and a request for three waiting."""
    holder = subprocess.Popen([*FULL, "run", "-q", "--gpus", "2", "--", "sleep", "60"], env=broker.env,
                              stderr=subprocess.PIPE, text=True)
    assert "lease l-" in holder.stderr.readline()
    waiter = subprocess.Popen([*FULL, "run", "-q", "--gpus", "3", "--", "true"], env=broker.env,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and "queue (1 waiting)" not in broker.vaccel("status").stdout:
        time.sleep(0.1)
    yield broker
    for proc in (waiter, holder):
        proc.terminate()
        proc.wait(10)


def test_the_ready_made_status_is_what_the_full_cli_prints(held: Broker):
    env = {**held.env, "TZ": CLIENT_TZ}
    code, text, err = same_output(["status"], env)
    assert code == 0 and err == ""
    assert "leased" in text and "queue (1 waiting)" in text
    code, text, err = same_output(["status", "--json"], env)
    assert code == 0 and err == ""
    assert sum(d["state"] == "leased" for d in json.loads(text)["devices"]) == 2
    # The socket named on the command line, before or after the command, as the full CLI reads it.
    other = {k: v for k, v in env.items() if k != "VACCEL_SOCKET"}
    for argv in (["--socket", str(held.socket), "status"], ["status", f"--socket={held.socket}", "--json"]):
        code, text, _ = same_output(argv, other)
        assert code == 0 and text.startswith(("host ", "{"))


def test_the_clock_is_the_viewers_and_nothing_else_is_rewritten():
    from vaccel_common.side_call import local_text, marked_text

    ts = 1_700_000_000.5
    line = "gpu0  x  03:11 (1s ago)  03:11"  # only the marked one is a lease's clock
    os.environ["TZ"] = CLIENT_TZ
    time.tzset()
    try:
        shown = local_text(marked_text(line, [(9, ts)]))
        assert shown == f"gpu0  x  {time.strftime('%H:%M', time.localtime(ts))} (1s ago)  03:11"
        with pytest.raises(ValueError):
            local_text(marked_text(line, [(3, ts)]))  # not where a clock is
        with pytest.raises(ValueError):
            local_text(b"12\nshort")
    finally:
        del os.environ["TZ"]
        time.tzset()


def test_the_ready_made_status_imports_only_what_it_needs(broker: Broker):
    code = f"""
import sys
before = set(sys.modules)
from vaccel.entry import ready_made
text = ready_made(None, False)
assert text is not None and text.startswith("host "), text
print(sorted(set(sys.modules) - before - {JUSTIFIED!r}))
"""
    done = subprocess.run([sys.executable, "-c", code], env=broker.env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [
    ["status", "--help"], ["--help"], ["status", "--sock", "/nowhere"], ["status", "--json", "--json"],
    ["statsu"], ["status", "extra"], ["--json", "status"], ["status", "--socket"], ["leases", "--json"],
])
def test_what_the_entry_does_not_read_the_full_cli_answers(broker: Broker, argv: list[str]):
    from vaccel.entry import status_asked

    assert status_asked(argv) is None
    same_output(argv, broker.env)


def test_without_a_broker_or_with_one_that_serves_no_views_the_full_cli_answers(tmp_path: Path):
    env = {**os.environ, "VACCEL_SOCKET": str(tmp_path / "brokerd.sock")}
    code, _, err = same_output(["status"], env)
    assert code == 69 and err.startswith("vaccel: cannot reach the vaccel broker")
    # A broker from before views: the token line, then it hangs up on the request.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as older:
        older.bind(str(tmp_path / "brokerd.sock.id"))
        older.listen(8)
        stop = threading.Event()

        def serve() -> None:
            older.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = older.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.sendall(b'{"token": "t.x", "expires": 9e9, "uid": 0, "pid": 1}\n')

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            from vaccel.entry import ready_made

            assert ready_made(str(tmp_path / "brokerd.sock"), False) is None
            code, _, err = same_output(["status"], env)
            assert code == 69 and "cannot reach the vaccel broker" in err
        finally:
            stop.set()
            server.join(5)


def _as(broker: Broker, packages: Path) -> dict[str, str]:
    """The environment a user runs the staged packages in (tests/test_multiuser.py as_user)."""
    return {"PATH": "/usr/bin:/bin", "VACCEL_SOCKET": str(broker.socket), "PYTHONPATH": str(packages), "HOME": "/",
            "TZ": CLIENT_TZ}


@pytest.mark.multiuser
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create users")
def test_another_user_sees_the_same_status_on_both_paths(root_broker: Broker, staged: Path):  # noqa: F811
    holder, lease_id = alice_holds_a_gpu(root_broker, staged)
    try:
        env = _as(root_broker, staged)
        for argv in (["status"], ["status", "--json"]):
            code, text, _ = same_output(argv, env, user="vaccel-bob")
            assert code == 0 and lease_id in text and "vaccel-alice" in text
    finally:
        holder.terminate()
        holder.wait(10)


@pytest.mark.multiuser
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create users")
def test_a_user_flooding_the_identity_socket_does_not_stop_anothers_status(root_broker: Broker,  # noqa: F811
                                                                           staged: Path):  # noqa: F811
    from brokerd.edge.side_calls import PER_USER

    hostile = Path(tempfile.mkdtemp(prefix="vaccel-flood-"))
    os.chmod(hostile, 0o755)
    script = hostile / "hostile_client.py"
    script.write_text((Path(__file__).parent / "hostile_client.py").read_text())
    os.chmod(script, 0o644)
    flood = subprocess.Popen([sys.executable, str(script), "views", "8", str(2 * PER_USER)], user="vaccel-alice",
                             env=_as(root_broker, staged), cwd="/", stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(flood.stdout.readline() or "{}").get("started"), flood.stderr.read()
        asked = ("from vaccel.entry import ready_made; t = ready_made(None, False); "
                 "print('view' if t and t.startswith('host ') else 'none')")
        for _ in range(3):  # bob's ready-made status is answered while alice floods
            done = subprocess.run([sys.executable, "-c", asked], user="vaccel-bob", cwd="/", capture_output=True,
                                  text=True, timeout=60, env=_as(root_broker, staged))
            assert done.stdout.strip() == "view", done.stderr
        code, text, _ = same_output(["status"], _as(root_broker, staged), user="vaccel-bob")
        assert code == 0 and text.startswith("host ")
        out, err = flood.communicate(timeout=60)
        seen = json.loads(out.splitlines()[-1])
        assert seen.get("reply 0"), (seen, err)  # she was answered too, within her bounds
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
        shutil.rmtree(hostile, ignore_errors=True)
    assert root_broker.proc is not None and root_broker.proc.poll() is None
    assert "Traceback" not in root_broker.log.read_text()


def test_mig_instances_and_memory_shares_read_the_same_on_both_paths(start_broker, tmp_path: Path):
    """A GPU in MIG mode adds a line over its instances and each memory share a line under
    its device: the clocks the client rewrites must be the shares' and the leases' own."""
    from tests.test_sharing_cli import sharing_broker

    broker = sharing_broker(start_broker, tmp_path)
    holders = [subprocess.Popen([*FULL, "run", "-q", *asked, "--", "sleep", "60"], env=broker.env,
                                stderr=subprocess.PIPE, text=True)
               for asked in (["--device", "gpu1.1"], ["--memory", "20GiB"], ["--memory", "10GiB"])]
    try:
        for holder in holders:
            assert "lease l-" in holder.stderr.readline()
        env = {**broker.env, "TZ": CLIENT_TZ}
        code, text, err = same_output(["status"], env)
        assert code == 0 and err == ""
        assert "MIG mode, 2 instances" in text and text.count("share of ") == 2, text
        # Each share's and lease's start, in the client's zone (UTC+5:30): the marks were theirs.
        kolkata = {time.strftime("%H:%M", time.gmtime(time.time() + 5.5 * 3600 - back)) for back in (0, 60)}
        started = [line for line in text.splitlines() if "share of " in line or " l-" in line]
        assert len(started) == 3 and all(any(f"{hm} (" in line for hm in kolkata) for line in started), text
        assert same_output(["status", "--json"], env)[0] == 0
    finally:
        for holder in holders:
            holder.terminate()
            holder.wait(10)
