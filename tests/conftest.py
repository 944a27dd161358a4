"""Shared fixtures: a real vaccel-brokerd started as a subprocess on a socket in a temp dir.

`broker` yields a running daemon on the 4-GPU simulated lab server; `start_broker` starts
one with any inventory or config and can kill -9 and restart it on the same state.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.testbeds.broker import DEFAULT_CONFIG, LAB_INVENTORY, ROOT, Broker  # noqa: F401 - used by tests

# The session's container engines (started only by the tests that ask for them).
from tests.container_engine import docker_engine_fixture  # noqa: F401
from tests.podman_engine import rootful_podman_fixture, rootless_podman_fixture  # noqa: F401


def alive(pid: int) -> bool:
    """Whether a process runs (neither gone nor a zombie). It may go between any two looks at
    /proc, so a read that finds it gone says so rather than raising."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


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
