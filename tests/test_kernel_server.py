"""The vaccel kernel behind a real Jupyter server (jupyter_server, driven through its REST
API and kernel websocket as JupyterLab drives it) against a real daemon: a lease that ends
behind the kernel's back stays ended across Jupyter's automatic restart, a refused start
answers with the broker's words, a waiting kernel is listed and deletable and leaves the
queue when deleted or abandoned, `!vaccel` works from a server whose venv is not on PATH,
and the kernel leases without importing torch."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Broker, alive
from tests.jupyter_server import JupyterServer
from tests.test_multiuser import status, wait_for

pytestmark = pytest.mark.timeout(180)
# Long enough to see Jupyter's restarter (it polls every 3 s) come and go several times.
NO_NEW_LEASE_S = 8.0


def install(broker: Broker, data_dir: Path, *args: str) -> None:
    r = broker.vaccel("kernel", "install", "--user", *args, env={**broker.env, "JUPYTER_DATA_DIR": str(data_dir)})
    assert r.returncode == 0, r.stderr


def jupyter_env(broker: Broker, workdir: Path, **extra: str) -> dict[str, str]:
    return {**broker.env, "JUPYTER_DATA_DIR": str(workdir / "data"), "JUPYTER_RUNTIME_DIR": str(workdir / "runtime"),
            **extra}


@pytest.fixture
def server_for(tmp_path: Path) -> Iterator:
    """A factory: server_for(broker, *install_args, **env) -> a started JupyterServer whose
    kernelspec is `vaccel kernel install --user *install_args`."""
    started: list[JupyterServer] = []

    def start(broker: Broker, *install_args: str, **env: str) -> JupyterServer:
        workdir = tmp_path / f"jupyter{len(started)}"
        workdir.mkdir()
        install(broker, workdir / "data", *install_args)
        server = JupyterServer(workdir, jupyter_env(broker, workdir, **env))
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def leases(broker: Broker) -> set[str]:
    return {d["lease_id"] for d in status(broker)["devices"] if d["lease_id"]}


def start_kernel(server: JupyterServer, name: str = "vaccel-1gpu") -> str:
    reply = server.api("POST", "/api/kernels", {"name": name})
    assert reply.status == 201, reply.body
    return reply.body["id"]


def lease_in_cell(server: JupyterServer, kernel_id: str) -> str:
    cell = server.execute(kernel_id, "import vaccel; print(vaccel.current_lease().id)")
    assert cell.status == "ok", cell
    return cell.stdout.strip()


def stopped_cell(server: JupyterServer, kernel_id: str, timeout: float = 60) -> dict:
    """The error a cell of the kernel Jupyter restarted by itself answers with."""
    cell = server.execute(kernel_id, "print('computing')", timeout=timeout)
    assert cell.status == "error" and "computing" not in cell.stdout
    assert cell.error is not None and cell.error["ename"] == "LeaseEnded"
    return cell.error


def no_lease_for(broker: Broker, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen = status(broker)
        assert not any(d["lease_id"] for d in seen["devices"]) and not seen["queue"], seen
        time.sleep(0.5)


def test_a_revoked_kernel_stops_and_only_the_users_restart_leases_again(broker: Broker, server_for):
    server = server_for(broker)
    kernel_id = start_kernel(server)
    first = lease_in_cell(server, kernel_id)
    assert leases(broker) == {first}

    # An admin revokes the lease while a cell runs: the cell says why, the kernel stops.
    revoke = subprocess.Popen(["sh", "-c", f"sleep 1; exec {broker.python} -m vaccel.cli release {first}"],
                              env=broker.env)
    cell = server.execute(kernel_id, "import time; time.sleep(60)", until="the kernel stops")
    assert revoke.wait(timeout=30) == 0
    assert f"lease {first}" in cell.stderr and "Restart it for a new lease" in cell.stderr

    # Jupyter restarts the dead kernel by itself: it comes back without a lease, says why in
    # every cell, and nothing takes a device or queues for one.
    error = wait_for(lambda: _stopped_error(server, kernel_id), timeout=60)
    assert first in error["evalue"] and "until you restart it" in error["evalue"]
    assert server.kernel(kernel_id) is not None  # still listed: the user can restart it
    no_lease_for(broker, NO_NEW_LEASE_S)
    assert "restarted without a lease" in server.log.read_text()

    # The user's restart asks for a new lease.
    assert server.api("POST", f"/api/kernels/{kernel_id}/restart").status == 200
    second = lease_in_cell(server, kernel_id)
    assert second != first and leases(broker) == {second}
    assert server.api("DELETE", f"/api/kernels/{kernel_id}").status == 204
    wait_for(lambda: not leases(broker))


def _stopped_error(server: JupyterServer, kernel_id: str) -> dict | None:
    try:
        return stopped_cell(server, kernel_id, timeout=15)
    except (AssertionError, TimeoutError):
        return None  # still the old kernel's end, or the restart under way


def test_a_time_limit_ends_the_notebooks_lease_for_good(start_broker, server_for):
    broker = start_broker(config='[leases]\nheartbeat_ttl = "3s"\n[probe]\nrefresh_interval = "1s"\n'
                                 '[policy.default]\ntime_default = "6s"\n')
    server = server_for(broker)
    kernel_id = start_kernel(server)
    first = lease_in_cell(server, kernel_id)
    error = wait_for(lambda: _stopped_error(server, kernel_id), timeout=60)
    assert first in error["evalue"]
    no_lease_for(broker, NO_NEW_LEASE_S)


def test_a_refused_start_answers_with_the_brokers_reason(broker: Broker, server_for):
    server = server_for(broker, "--on-busy", "fail")
    everything = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--gpus", "4", "--", "sleep", "60"],
                                  env=broker.env)
    try:
        wait_for(lambda: len(leases(broker)) == 1 and all(d["lease_id"] for d in status(broker)["devices"]))
        reply = server.api("POST", "/api/kernels", {"name": "vaccel-1gpu"})
        assert reply.status == 503, reply.body
        message = reply.body["message"]
        assert message.startswith("no device for this kernel: no free device")
        assert "gpu0 root since" in message  # who holds what, as the broker says it
        assert server.api("GET", "/api/kernels").body == []
        # The server's log says it in one line, as an answer refused, not as a crash.
        log = server.log.read_text()
        assert "Traceback" not in log, log
        assert sum("vaccel kernel start refused: no device for this kernel: no free device" in line
                   for line in log.splitlines()) == 1, log
    finally:
        everything.kill()
        everything.wait()


def test_a_waiting_kernel_is_listed_deletable_and_leaves_the_queue(broker: Broker, server_for):
    server = server_for(broker)
    everything = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--gpus", "4", "--", "sleep", "60"],
                                  env=broker.env)
    try:
        wait_for(lambda: all(d["lease_id"] for d in status(broker)["devices"]))
        kernel_id = start_kernel(server)  # answered while the kernel waits
        assert server.kernel(kernel_id)["execution_state"] in ("starting", "busy")
        (waiting,) = status(broker)["queue"]
        assert server.api("DELETE", f"/api/kernels/{kernel_id}").status == 204
        assert server.kernel(kernel_id) is None
        wait_for(lambda: not status(broker)["queue"])
        assert not alive(waiting["requester"]["pid"])

        # Abandoned: the server dies (kill -9) while a kernel waits; the kernel leaves the queue.
        start_kernel(server)
        (waiting,) = wait_for(lambda: status(broker)["queue"])
        server.kill9()
        wait_for(lambda: not status(broker)["queue"])
        wait_for(lambda: not alive(waiting["requester"]["pid"]))
    finally:
        everything.kill()
        everything.wait()
    assert not leases(broker)  # nobody took the devices when they freed


def test_vaccel_works_in_a_cell_when_the_servers_venv_is_not_on_path(broker: Broker, server_for):
    server = server_for(broker, PATH="/usr/bin:/bin")
    kernel_id = start_kernel(server)
    cell = server.execute(kernel_id, "!vaccel status")
    assert cell.status == "ok", cell
    assert "command not found" not in cell.stdout + cell.stderr
    lease_id = lease_in_cell(server, kernel_id)
    assert lease_id in cell.stdout and "gpu0" in cell.stdout


def test_the_kernel_leases_without_importing_torch(broker: Broker, server_for):
    server = server_for(broker)
    kernel_id = start_kernel(server)
    cell = server.execute(kernel_id, "import sys; print('torch' in sys.modules)")
    assert cell.stdout.strip() == "False"
    cell = server.execute(kernel_id, "import torch, vaccel; print(vaccel.current_lease().backend)")
    assert cell.status == "ok", cell  # the notebook imports it itself, as usual
