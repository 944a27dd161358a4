"""Shared fixtures: a real vaccel-brokerd started as a subprocess on a socket in a temp dir.

`broker` yields a running daemon on the 4-GPU simulated lab server; `start_broker` starts
one with any inventory or config and can kill -9 and restart it on the same state.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The session's container engines (started only by the tests that ask for them).
from tests.container_engine import docker_engine_fixture  # noqa: F401
from tests.podman_engine import rootful_podman_fixture, rootless_podman_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
LAB_INVENTORY = ROOT / "examples" / "lab-server.yaml"


class Broker:
    """One daemon process. `env` is what a client subprocess needs to find it."""

    def __init__(self, workdir: Path, inventory: Path | None, config_text: str, python: str = sys.executable):
        self.workdir = workdir
        self.socket = workdir / "run" / "brokerd.sock"
        self.state_dir = workdir / "state"
        self.config = workdir / "brokerd.toml"
        self.config.write_text(config_text)
        self.inventory = inventory
        self.python = python
        self.log = workdir / "brokerd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = {**os.environ, "VACCEL_SOCKET": str(self.socket), "PYTHONUNBUFFERED": "1"}
        self.env.pop("VACCEL_LEASE_ID", None)

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "brokerd", "--config", str(self.config), "--socket", str(self.socket),
               "--state-dir", str(self.state_dir)]
        if self.inventory is not None:
            cmd += ["--inventory", str(self.inventory)]
        return cmd

    def start(self, timeout: float = 20.0) -> Broker:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        id_socket = self.socket.with_name(self.socket.name + ".id")
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited with {self.proc.returncode}:\n{self.log.read_text()}")
            # Connect, not just exists(): a kill -9 leaves stale socket files behind.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(id_socket))
                return self
            except OSError:
                time.sleep(0.02)
            finally:
                probe.close()
        raise RuntimeError(f"broker did not start in {timeout}s:\n{self.log.read_text()}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def vaccel(self, *args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess[str]:
        """Run the `vaccel` CLI against this broker."""
        return subprocess.run([self.python, "-m", "vaccel.cli", *args], env=kwargs.pop("env", self.env),
                              capture_output=True, text=True, timeout=timeout, **kwargs)


DEFAULT_CONFIG = """
[leases]
heartbeat_ttl = "3s"
[probe]
refresh_interval = "1s"
"""


@pytest.fixture
def start_broker() -> Iterator:
    """A factory: start_broker(inventory=..., config=...) -> Broker; all are stopped afterwards.
    Work dirs live directly under /tmp: a Unix socket path must stay under 108 bytes."""
    started: list[Broker] = []
    made: list[Path] = []

    def start(inventory: Path | None = LAB_INVENTORY, config: str = DEFAULT_CONFIG, workdir: Path | None = None,
              python: str = sys.executable) -> Broker:
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="vaccel-"))
            made.append(workdir)
        b = Broker(workdir, inventory, config, python)
        started.append(b)
        return b.start()

    yield start
    for b in started:
        b.stop()
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def broker(start_broker) -> Broker:
    """A running daemon serving the simulated 4-GPU lab server."""
    return start_broker()
