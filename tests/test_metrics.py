"""The Prometheus endpoint of a real daemon, scraped over real HTTP and read with
prometheus-client's own parser; dcgm-exporter's job-mapping files; and HTTP clients that
send half a request, garbage or nothing, while leases go on being granted."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from brokerd.addons.job_mapping import JobMapping
from brokerd.base.process import Holder
from brokerd.leasing.model import Lease
from tests.conftest import LAB_INVENTORY
from tests.test_multiuser import wait_for

DCGM_LABELS = {"gpu", "UUID", "pci_bus_id", "modelName", "Hostname"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vaccel-m-"))  # short: the socket path must fit 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def metrics_config(port: int, mapping: Path) -> str:
    return (f'[leases]\nheartbeat_ttl = "3s"\n[probe]\nrefresh_interval = "1s"\n'
            f'[metrics]\nlisten = "127.0.0.1:{port}"\nhpc_job_mapping_dir = "{mapping}"\n')


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(families: dict[str, list], sample_name: str, **labels: str) -> float:
    matches = [s.value for fam in families.values() for s in fam
               if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (sample_name, labels, matches)
    return matches[0]


def test_metrics_follow_a_lease_with_labels_that_join_dcgm_exporter(start_broker, workdir):
    port, mapping = free_port(), workdir / "jobmap"
    broker = start_broker(LAB_INVENTORY, metrics_config(port, mapping), workdir=workdir)
    me = pwd.getpwuid(os.getuid()).pw_name
    before = scrape(port)
    assert value(before, "vaccel_devices", state="free") == 4
    assert value(before, "vaccel_leases_active") == 0

    holder = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--", "sh", "-c",
                               "echo $VACCEL_LEASE_ID; exec sleep 60"], env=broker.env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        lease_id = holder.stdout.readline().strip()
        assert lease_id.startswith("l-")
        during = scrape(port)
        assert value(during, "vaccel_leases_active") == 1
        assert value(during, "vaccel_devices", state="leased") == 1
        held = list(during["vaccel_device_lease_info"])
        assert len(held) == 1 and held[0].labels["lease_id"] == held[0].labels["hpc_job"] == lease_id
        assert held[0].labels["user"] == me and DCGM_LABELS <= set(held[0].labels)
        status = json.loads(broker.vaccel("status", "--json").stdout)
        device = next(d for d in status["devices"] if d["lease_id"] == lease_id)
        assert (held[0].labels["UUID"], held[0].labels["gpu"]) == (device["uuid"], str(device["index"]))
        assert held[0].labels["modelName"] == device["name"]
        assert value(during, "vaccel_device_memory_total_bytes", UUID=device["uuid"]) == device["memory_mib"] << 20
        # dcgm-exporter's --hpc-job-mapping-dir: a file named by the GPU index, one job id a line
        assert wait_for(lambda: (mapping / str(device["index"])).is_file())
        assert (mapping / str(device["index"])).read_text() == lease_id + "\n"

        assert broker.vaccel("release", lease_id).returncode == 0
        holder.wait(timeout=30)
    finally:
        holder.kill()
        holder.wait()
    wait_for(lambda: not (mapping / str(device["index"])).exists())
    after = scrape(port)
    assert value(after, "vaccel_leases_active") == 0
    assert value(after, "vaccel_lease_grants_total", kind="lease") == 1
    assert value(after, "vaccel_lease_ends_total", reason="released") == 1
    assert value(after, "vaccel_lease_ends_total", reason="expired") == 0
    assert value(after, "vaccel_lease_wait_seconds_count") == 1
    # Device-hours by user are other users' history: by default one series, nobody named (issue 31).
    assert value(after, "vaccel_device_hours_total", user="") > 0
    assert not [s for s in after["vaccel_device_hours"] if s.labels.get("user")]


def test_slow_and_garbage_http_clients_never_stall_the_lease_path(start_broker, workdir):
    port = free_port()
    broker = start_broker(LAB_INVENTORY, metrics_config(port, workdir / "jobmap"), workdir=workdir)
    clients = []
    try:
        for i in range(24):  # three times the server's connection limit
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 3 == 0:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # half a request, never finished
            elif i % 3 == 1:
                s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64))  # a TLS hello
            clients.append(s)  # the rest connect and say nothing
        run = broker.vaccel("run", "--", "true")
        assert run.returncode == 0, run.stderr
        assert broker.vaccel("status").returncode == 0
    finally:
        for s in clients:
            s.close()
    # Their threads end with their connections: the endpoint serves again.
    assert wait_for(lambda: _scrapes(port))
    assert value(scrape(port), "vaccel_lease_grants_total", kind="lease") == 1


def _scrapes(port: int) -> bool:
    try:
        scrape(port)
        return True
    except OSError:
        return False


def test_a_busy_metrics_port_leaves_the_broker_serving(start_broker, workdir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        broker = start_broker(LAB_INVENTORY, metrics_config(port, workdir / "jobmap"), workdir=workdir)
        run = broker.vaccel("run", "--", "true")
        assert run.returncode == 0, run.stderr
    assert "metrics: cannot serve on 127.0.0.1:" in broker.log.read_text()


def test_job_mapping_reconciles_after_a_restart_and_leaves_other_files(tmp_path):
    (tmp_path / "0").write_text("l-ended-while-down\n")
    (tmp_path / "5").write_text("slurm-4242\n")  # another tool's mapping: not ours to remove
    (tmp_path / "notes").write_text("l-x\n")
    holder = Holder(1000, 1000, 1, 1, "alice", "")
    restored = Lease(id="l-live", holder=holder, devices=("GPU-b",), backend="cpu", granted_at=1.0)
    mapping = JobMapping(tmp_path, {"GPU-a": 0, "GPU-b": 1}.get)
    mapping.restored([restored])
    mapping.granted(Lease(id="l-new", holder=holder, devices=("GPU-a",), backend="cpu", granted_at=2.0))
    mapping.ended(restored)
    mapping._worker.shutdown(wait=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "5", "notes"]
    assert (tmp_path / "0").read_text() == "l-new\n"
    assert (tmp_path / "5").read_text() == "slurm-4242\n"


def test_a_request_trickled_in_is_dropped_after_the_whole_request_deadline(start_broker, workdir):
    """The old threaded server's timeout was per read: a byte every few seconds kept a
    request (and one of its 8 threads) forever. Now the request as a whole must arrive
    within REQUEST_TIMEOUT_S (issue 31 item 9)."""
    from brokerd.addons.metrics import REQUEST_TIMEOUT_S

    port = free_port()
    start_broker(LAB_INVENTORY, metrics_config(port, workdir / "jobmap"), workdir=workdir)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
        slow.settimeout(1.0)
        opened, closed = time.monotonic(), None
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 60:
            try:
                slow.send(bytes([byte]))
                if slow.recv(1) == b"":
                    closed = time.monotonic()
                    break
            except TimeoutError:
                continue  # still open: nothing to read yet
            except OSError:
                closed = time.monotonic()
                break
        assert closed is not None, "a request trickled in for a minute was never dropped"
    print(f"\nthe trickled request was dropped after {closed - opened:.1f}s (deadline {REQUEST_TIMEOUT_S:.0f}s)")
    assert scrape(port)["vaccel_devices"]
