"""The vaccel Jupyter kernel with a real jupyter_client against a real daemon: installed
with `vaccel kernel install`, started from its kernelspec (through the vaccel provisioner,
as a Jupyter server starts it), it holds a device exactly while its process lives."""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import AsyncKernelManager, KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from vaccel.kernel.provisioner import KernelStartRefused

from tests.conftest import Broker
from tests.test_multiuser import status, wait_for

pytestmark = pytest.mark.timeout(60)
ME = pwd.getpwuid(os.getuid()).pw_name


@pytest.fixture
def jupyter_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Jupyter's data and runtime folders for this test only (kernelspecs, connection files)."""
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    return tmp_path


def install(broker: Broker, *args: str) -> subprocess.CompletedProcess[str]:
    """`vaccel kernel install --user ARGS` into this test's Jupyter folder."""
    env = {**broker.env, "JUPYTER_DATA_DIR": os.environ["JUPYTER_DATA_DIR"]}
    return broker.vaccel("kernel", "install", "--user", *args, env=env)


@pytest.fixture
def kernel(broker: Broker, jupyter_dir: Path) -> Iterator[KernelManager]:
    assert install(broker).returncode == 0
    km = KernelManager(kernel_name="vaccel-1gpu")
    km.start_kernel(env=dict(broker.env))
    yield km
    if km.has_kernel:
        km.shutdown_kernel(now=True)


def run_cell(km: KernelManager, code: str) -> tuple[dict[str, Any], str]:
    """Execute `code`; (the reply's content, what it printed)."""
    client = km.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=30)
        out: list[str] = []
        reply = client.execute_interactive(code, timeout=30, output_hook=lambda m: out.append(
            m["content"].get("text", "") if m["msg_type"] == "stream" else ""))
        return reply["content"], "".join(out)
    finally:
        client.stop_channels()


def lease_of(km: KernelManager) -> str:
    reply, out = run_cell(km, "import vaccel; print(vaccel.current_lease().id)")
    assert reply["status"] == "ok", reply
    return out.strip()


def held_by(broker: Broker, pid: int) -> list[dict]:
    return [d for d in status(broker)["devices"] if d["holder"] and d["holder"]["pid"] == pid]


def test_install_writes_a_kernelspec_that_jupyter_lists(broker: Broker, jupyter_dir: Path):
    r = install(broker, "--gpus", "2", "--on-busy", "fail")
    assert r.returncode == 0, r.stderr
    assert "vaccel-2gpu" in r.stdout
    spec = KernelSpecManager().get_kernel_spec("vaccel-2gpu")
    assert spec.display_name == "Python 3 (vaccel, 2 GPUs, fails at once when busy)"  # not the waiting one's
    assert spec.argv[1:] == ["-m", "vaccel.kernel", "-f", "{connection_file}", "--gpus", "2", "--on-busy", "fail"]
    assert spec.metadata["kernel_provisioner"]["provisioner_name"] == "vaccel-provisioner"
    r = install(broker, "--gpus", "0")
    assert r.returncode == 2 and "--gpus" in r.stderr
    r = install(broker, "--gpus", "2", "--name", "vaccel-2gpu-wait")
    assert r.returncode == 0, r.stderr
    assert KernelSpecManager().get_kernel_spec("vaccel-2gpu-wait").display_name == "Python 3 (vaccel, 2 GPUs)"


def test_a_cell_sees_its_lease_and_an_interrupt_keeps_the_kernel(broker: Broker, kernel: KernelManager):
    reply, out = run_cell(kernel, "import os, vaccel\n"
                                  "print(os.environ['CUDA_VISIBLE_DEVICES'], vaccel.current_lease().id)")
    assert reply["status"] == "ok", reply
    visible, lease_id = out.split()
    (device,) = held_by(broker, kernel.provisioner.pid)  # the kernel process holds it itself
    assert (device["uuid"], device["lease_id"]) == (visible, lease_id)
    reply, out = run_cell(kernel, "%vaccel")
    assert f"lease {lease_id}: gpu{device['index']}" in out and "time left" in out

    client = kernel.client()
    client.start_channels()
    try:
        msg_id = client.execute("import time; print('sleeping', flush=True); time.sleep(30)")
        wait_for(lambda: _printed(client, msg_id, "sleeping"), timeout=60)
        kernel.interrupt_kernel()
        reply = client.get_shell_msg(timeout=20)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "KeyboardInterrupt"
    finally:
        client.stop_channels()
    assert lease_of(kernel) == lease_id  # same kernel, same lease

    kernel.shutdown_kernel()
    wait_for(lambda: status_of(broker, device["uuid"]) == "free", timeout=60)


def _printed(client: Any, msg_id: str, text: str) -> bool:
    msg = client.get_iopub_msg(timeout=20)
    return msg["parent_header"].get("msg_id") == msg_id and text in msg["content"].get("text", "")


def status_of(broker: Broker, uuid: str) -> str:
    return next(d["state"] for d in status(broker)["devices"] if d["uuid"] == uuid)


def test_a_restart_takes_a_new_lease_and_kill_9_frees_the_device(broker: Broker, kernel: KernelManager):
    first = lease_of(kernel)
    kernel.restart_kernel()
    second = lease_of(kernel)
    assert second != first
    leases = {d["lease_id"] for d in status(broker)["devices"] if d["lease_id"]}
    assert leases == {second}  # the first kernel's lease ended with its process

    pid = kernel.provisioner.pid
    (device,) = held_by(broker, pid)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: status_of(broker, device["uuid"]) == "free", timeout=60)


def test_a_kernel_whose_lease_ends_behind_its_back_says_so_and_stops(broker: Broker, kernel: KernelManager):
    lease_id = lease_of(kernel)
    client = kernel.client()
    client.start_channels()
    try:
        msg_id = client.execute("import time; print('working', flush=True); time.sleep(30)")
        wait_for(lambda: _printed(client, msg_id, "working"), timeout=60)
        r = broker.vaccel("release", lease_id)  # from a terminal: the kernel did not ask for it
        assert r.returncode == 0, r.stderr
        wait_for(lambda: _printed(client, msg_id, "the kernel stops"), timeout=60)
    finally:
        client.stop_channels()
    wait_for(lambda: not kernel.is_alive(), timeout=60)  # not computing on a device it lost


def test_all_devices_taken_a_kernel_fails_with_the_queue_or_waits(broker: Broker, jupyter_dir: Path):
    assert install(broker, "--name", "vaccel-fail", "--on-busy", "fail").returncode == 0
    assert install(broker, "--name", "vaccel-wait").returncode == 0
    everything = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--gpus", "4", "--",
                                   "sleep", "60"], env=broker.env)
    try:
        wait_for(lambda: all(d["state"] == "leased" for d in status(broker)["devices"]))
        km = KernelManager(kernel_name="vaccel-fail")
        with pytest.raises(KernelStartRefused) as refused:
            km.start_kernel(env=dict(broker.env))
        assert "no device for this kernel" in str(refused.value)
        assert f"gpu0 {ME} since" in str(refused.value)  # the broker's queue message: who holds what
        assert not km.is_alive()
        asyncio.run(_wait_then_start(broker, everything))
    finally:
        everything.kill()
        everything.wait()


async def _wait_then_start(broker: Broker, everything: subprocess.Popen[bytes]) -> None:
    """The waiting kernel's start ends with its first queue message (so the server lists it
    and can delete it), its queue place goes to the server's log, and the kernel takes the
    lease once the holder gives the devices back."""
    km = AsyncKernelManager(kernel_name="vaccel-wait")
    log = _ListHandler()
    km.log = logging.getLogger("test_kernel.server")
    km.log.addHandler(log)
    km.log.setLevel(logging.INFO)
    try:
        await asyncio.wait_for(km.start_kernel(env=dict(broker.env)), timeout=60)
        assert await km.is_alive()
        assert [w["requester"]["pid"] for w in status(broker)["queue"]] == [km.provisioner.pid]
        assert any("position 1 of 1" in m for m in log.messages)
        assert not held_by(broker, km.provisioner.pid)
        everything.terminate()  # `vaccel run` passes it on and releases
        while not held_by(broker, km.provisioner.pid):
            await asyncio.sleep(0.1)
        client = km.client()
        client.start_channels()
        await client.wait_for_ready(timeout=30)  # IPython runs once the lease is held
        client.stop_channels()
        assert any(m.startswith(f"vaccel kernel {km.kernel_id}: lease l-") for m in log.messages)
    finally:
        await km.shutdown_kernel(now=True)


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_kernel_reports_without_a_provisioner_on_stderr(broker: Broker, tmp_path: Path):
    # Started by anything but the provisioner (no report pipe): a refusal is one line on
    # stderr and a non-zero exit, before IPython is even imported.
    everything = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--gpus", "4", "--",
                                   "sleep", "60"], env=broker.env)
    try:
        wait_for(lambda: all(d["state"] == "leased" for d in status(broker)["devices"]))
        r = subprocess.run([broker.python, "-m", "vaccel.kernel", "-f", str(tmp_path / "k.json"), "--on-busy",
                            "fail"], env=broker.env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 75
        assert r.stderr.startswith("vaccel: no free device")
        assert f"gpu0 {ME} since" in r.stderr
    finally:
        everything.kill()
        everything.wait()
