"""A hostile neighbour, second pass (issue 31): the surfaces added last round. The daemon
runs as root with the dashboard and the metrics on, the attacker is a real Unix user
(vaccel-alice, attacks in tests/hostile_client.py and tests/hostile_http.py), and a
well-behaved user (vaccel-bob) keeps getting a GPU with `vaccel run --no-wait --gpus 1
-- true` meanwhile (its time is printed). docs/security.md maps each class to its
mechanism and to its test here; the Slurm items are tests/test_slurm_delegate.py's, the
group limits tests/test_hostile_groups.py's, enforcement after a crash tests/test_enforce.py's.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from brokerd.addons.web.push import MAX_PER_CLIENT
from brokerd.addons.web.server import PER_CLIENT_CONNECTIONS
from tests.conftest import ROOT, Broker
from tests.test_dashboard import free_port
from tests.test_hostile import THREE_GPUS, attack, bob_gets_a_gpu, stop
from tests.test_multiuser import as_user, status, wait_for
from tests.test_multiuser import staged as staged_packages  # noqa: F401 - a fixture, used by name

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="hostile-user tests need root to create users"),
]

ALICE, BOB = "vaccel-alice", "vaccel-bob"


class Surfaces:
    def __init__(self, broker: Broker, staged: Path, web: int, metrics: int) -> None:
        self.broker, self.staged, self.web, self.metrics = broker, staged, web, metrics

    def get(self, port: int, path: str, user: str = BOB, timeout: float = 10) -> tuple[int, str]:
        """GET as `user` (a real user: the servers tell clients apart by the kernel's uid)."""
        code = ("import sys, urllib.request, urllib.error\n"
                "try:\n    r = urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2]))\n"
                "    print(r.status); sys.stdout.write(r.read().decode())\n"
                "except urllib.error.HTTPError as e:\n    print(e.code); sys.stdout.write(e.read().decode())\n")
        r = subprocess.run([sys.executable, "-c", code, f"http://127.0.0.1:{port}{path}", str(timeout)], user=user,
                           cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                           timeout=timeout + 30)
        assert r.returncode == 0, r.stderr
        first, _, body = r.stdout.partition("\n")
        return int(first), body

    def http_attack(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, str(self.staged / "hostile_http.py"), *args], user=ALICE,
                                cwd="/", env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def surfaces(staged_packages: Path) -> Iterator[Surfaces]:  # noqa: F811 - the fixture
    staged = staged_packages
    for name in ("hostile_client.py", "hostile_http.py"):
        shutil.copy(ROOT / "tests" / name, staged / name)
        os.chmod(staged / name, 0o644)
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-hs-"))
    os.chmod(workdir, 0o755)
    (workdir / "gpus.yaml").write_text(THREE_GPUS)
    web, metrics = free_port(), free_port()
    config = (f'[leases]\nheartbeat_ttl = "2s"\n[web]\nlisten = "127.0.0.1:{web}"\n'
              f'[metrics]\nlisten = "127.0.0.1:{metrics}"\n')
    broker = Broker(workdir, workdir / "gpus.yaml", config).start()
    yield Surfaces(broker, staged, web, metrics)
    broker.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def reported_leases(broker: Broker, user: str, staged: Path) -> int:
    """How many leases `user`'s own `vaccel report` counts; fails (not hangs) when it cannot answer."""
    env = {"PATH": "/usr/bin:/bin", "VACCEL_SOCKET": str(broker.socket), "PYTHONPATH": str(staged), "HOME": "/"}
    try:
        r = subprocess.run([sys.executable, "-m", "vaccel.cli", "report", "--json"], user=user, env=env, cwd="/",
                           capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{user}'s `vaccel report` did not answer within 20 s: the accounting is stuck")
    assert r.returncode == 0, r.stderr
    return sum(row["leases"] for row in json.loads(r.stdout)["rows"])


# -- item 5: a caller that leaves never hurts the accounting --------------------------------


def test_abandoned_reports_leave_the_accounting_working(surfaces: Surfaces):
    broker, staged = surfaces.broker, surfaces.staged
    before = reported_leases(broker, BOB, staged)
    over_http = surfaces.http_attack("abandon", str(surfaces.web), "6", "5")
    seen = attack(broker, staged, "reports", "10", "10")  # Report RPCs given up after 2 to 50 ms, ten at once
    assert over_http.wait(60) == 0, over_http.stderr.read()
    print(f"\nreports given up: {seen}; over HTTP: {over_http.stdout.read().strip()}")
    assert seen.get("DEADLINE_EXCEEDED", 0) > 0, seen  # they did leave before their answer
    took = bob_gets_a_gpu(broker, staged)
    # Bob's report answers, and his lease's end was written (its row counts once ended).
    wait_for(lambda: reported_leases(broker, BOB, staged) == before + 1, timeout=20)
    print(f"bob's run during the attack: {took:.2f}s")
    log = broker.log.read_text()
    assert "Exception in thread" not in log and "Traceback" not in log, log[-3000:]


# -- item 4: the job-mapping folder is the daemon's own ---------------------------------------


def test_a_job_mapping_folder_another_user_made_first_is_refused_and_nothing_is_written_through_it(
    surfaces: Surfaces, start_broker
):
    staged = surfaces.staged
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-jm-"))
    os.chmod(workdir, 0o755)
    secret = workdir / "secret"  # a root-only file, as the daemon's key is
    secret.write_text("secret\n")
    os.chmod(secret, 0o600)
    folder = Path(tempfile.mktemp(prefix="vaccel-jm-squat-", dir="/tmp"))
    # Alice makes the folder first, in /tmp, with her links where the daemon will write
    # (the temporary file of gpu0 and the file of gpu1) and a FIFO for gpu2's.
    plant = (f"mkdir -m 777 {folder} && ln -s {secret} {folder}/.0.vaccel-tmp && ln -s {secret} {folder}/1 "
             f"&& mkfifo {folder}/.2.vaccel-tmp")
    subprocess.run(["sh", "-c", plant], user=ALICE, check=True, cwd="/")
    config = f'[leases]\nheartbeat_ttl = "2s"\n[metrics]\nhpc_job_mapping_dir = "{folder}"\n'
    try:
        broker = start_broker(surfaces.broker.inventory, config, workdir=workdir)
        r = as_user(broker, staged, BOB, "run", "--gpus", "3", "--", "sleep", "1")
        assert r.returncode == 0, r.stderr
        bob_gets_a_gpu(broker, staged)
        # The grants' files are written on the mapping's own thread: wait for its verdict.
        wait_for(lambda: "job mapping: refusing the folder" in broker.log.read_text()
                 or secret.read_text() != "secret\n" or stat.S_IMODE(secret.stat().st_mode) != 0o600)
        assert secret.read_text() == "secret\n"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert f"{folder} belongs to uid {pwd.getpwnam(ALICE).pw_uid}" in broker.log.read_text()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


# -- item 8: what anyone may see --------------------------------------------------------------


def test_the_dashboard_and_the_metrics_show_anyone_only_what_vaccel_status_shows(surfaces: Surfaces):
    broker, staged = surfaces.broker, surfaces.staged
    ended = as_user(broker, staged, ALICE, "run", "--", "sh", "-c", "echo $VACCEL_LEASE_ID")
    assert ended.returncode == 0, ended.stderr
    ended_id = ended.stdout.strip()
    holder = as_user(broker, staged, ALICE, "run", "--", "sh", "-c", "echo $VACCEL_LEASE_ID; sleep 60", popen=True)
    try:
        held_id = holder.stdout.readline().strip()
        assert held_id.startswith("l-")
        # Bob asks (any local user can): the timeline names the current holder only ...
        code, body = surfaces.get(surfaces.web, "/api/timeline?hours=24")
        assert code == 200
        spans = [s for d in json.loads(body)["devices"] for s in d["spans"]]
        assert ended_id not in body and {"user": ALICE, "lease_id": held_id}.items() <= \
            next(s for s in spans if s["end"] is None).items()
        assert all(s["user"] == s["lease_id"] == "" for s in spans if s["end"] is not None)
        # ... the status has no one's use against the limits ...
        code, body = surfaces.get(surfaces.web, "/api/status")
        assert code == 200 and json.loads(body)["usage"] == []
        mine = json.loads(as_user(broker, staged, BOB, "status", "--json").stdout)["usage"]
        assert ALICE not in {u["user"] for u in mine}
        assert ALICE in {u["user"] for u in status(broker)["usage"]}  # root, an admin, sees it
        # ... and /metrics has device-hours for everyone together, the holder of each device now.
        code, body = surfaces.get(surfaces.metrics, "/metrics")
        families = {f.name: f.samples for f in text_string_to_metric_families(body)}
        assert [s.labels.get("user", "") for s in families["vaccel_device_hours"]] == [""]
        assert {s.labels["user"] for s in families["vaccel_device_lease_info"]} == {ALICE}
        # A lab that makes usage public says so, and then both show who used what.
        broker.config.write_text(broker.config.read_text() + '[accounting]\nper_user_report = "everyone"\n')
        reloaded = broker.log.read_text().count("configuration reloaded")
        assert broker.proc is not None
        broker.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: broker.log.read_text().count("configuration reloaded") > reloaded)
        assert ended_id in surfaces.get(surfaces.web, "/api/timeline?hours=24")[1]
        assert f'user="{ALICE}"' in surfaces.get(surfaces.metrics, "/metrics")[1]
    finally:
        broker.config.write_text(broker.config.read_text().replace('[accounting]\nper_user_report = "everyone"\n',
                                                                   ""))
        assert broker.proc is not None
        broker.proc.send_signal(signal.SIGHUP)
        stop(holder)


# -- item 9: one user cannot keep the others off the read-only servers --------------------------


def test_one_user_holding_connections_keeps_only_themselves_off_the_dashboard_and_the_metrics(surfaces: Surfaces):
    broker, staged = surfaces.broker, surfaces.staged
    web, metrics = str(surfaces.web), str(surfaces.metrics)
    attacks = [surfaces.http_attack("streams", web, "70"), surfaces.http_attack("keepalive", web, "260"),
               surfaces.http_attack("trickle", metrics, "16")]
    try:
        got = [json.loads(a.stdout.readline() or "{}") for a in attacks]
        print(f"\nalice's streams: {got[0]}; keep-alive connections: {got[1]}; trickling scrapes: {got[2]}")
        assert got[0].get("200", 0) <= MAX_PER_CLIENT and got[1].get("200", 0) <= PER_CLIENT_CONNECTIONS, got
        # Everyone else: bob's page and its live stream, root's scrape (Prometheus), bob's GPU.
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as reply:
            assert reply.status == 200 and b"vaccel_devices" in reply.read()
        print(f"a scrape during the attack took {time.monotonic() - started:.2f}s")
        assert surfaces.get(surfaces.web, "/api/status")[0] == 200
        stream = ("import socket, sys\ns = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=10)\n"
                  "s.sendall(b'GET /events HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\n\\r\\n')\nprint(s.recv(12).decode())\n")
        r = subprocess.run([sys.executable, "-c", stream, web], user=BOB, cwd="/", capture_output=True, text=True,
                           timeout=30)
        assert r.stdout.strip() == "HTTP/1.1 200", (r.stdout, r.stderr)
        took = bob_gets_a_gpu(broker, staged)
        print(f"bob's run during the attack: {took:.2f}s")
    finally:
        for a in attacks:
            stop(a)


# -- item 10: papercuts ---------------------------------------------------------------------------


def test_a_reason_that_is_not_utf8_and_malformed_http_leave_no_traceback(surfaces: Surfaces):
    broker, staged = surfaces.broker, surfaces.staged
    holder = as_user(broker, staged, ALICE, "run", "--", "sh", "-c", "echo $VACCEL_LEASE_ID; sleep 60", popen=True)
    try:
        lease_id = holder.stdout.readline().strip()
        env = {"PATH": "/usr/bin:/bin", "VACCEL_SOCKET": str(broker.socket), "PYTHONPATH": str(staged), "HOME": "/"}
        r = subprocess.run([sys.executable.encode(), b"-m", b"vaccel.cli", b"release", lease_id.encode(),
                            b"--reason", b"done \xff\xfe"], user=ALICE, env=env, cwd="/", capture_output=True,
                           timeout=60)
        assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
        assert holder.wait(30) is not None
    finally:
        stop(holder)
    for port in (surfaces.web, surfaces.metrics):
        r = subprocess.run([sys.executable, str(staged / "hostile_http.py"), "garbage", str(port)], user=ALICE,
                           cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert set(json.loads(r.stdout)) <= {"400", "405", "501", "closed"}, r.stdout
    log = broker.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert re.search(r"(dashboard|metrics): a malformed HTTP request", log), log[-3000:]
