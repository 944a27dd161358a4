"""A real vaccel-brokerd as a subprocess on a socket in a folder of its own, for the tests
(tests/conftest.py wraps it in fixtures) and the benchmarks (no pytest needed here)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
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
        # The client's venv first on PATH, as an activated one: `vaccel run -- python3 ...` (and a
        # command that names no Python) is checked against the Python it runs (vaccel/contract/job_python.py).
        self.env = {**os.environ, "VACCEL_SOCKET": str(self.socket), "PYTHONUNBUFFERED": "1",
                    "PATH": os.pathsep.join([os.path.dirname(python), os.environ.get("PATH", os.defpath)])}
        self.env.pop("VACCEL_LEASE_ID", None)

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "brokerd", "--config", str(self.config), "--socket", str(self.socket),
               "--state-dir", str(self.state_dir)]
        if self.inventory is not None:
            cmd += ["--inventory", str(self.inventory)]
        return cmd

    def start(self, timeout: float = 60.0) -> Broker:  # the timeout only turns a hang into a failure
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
