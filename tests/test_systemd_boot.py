"""The real boot test: a real systemd as PID 1 of a container runs vaccel-brokerd as a service.

Inside a systemd-nspawn container booted from a debootstrap'd Debian root, the project is
installed as a lab installs it (scripts/install.sh, `sudo make install`: a wheel into /opt/vaccel)
from a wheelhouse built here, its `vaccel-brokerd install-units` installs the unit,
`systemctl start` starts the broker on simulated devices, an ordinary user holds a lease
through `vaccel run`, `systemctl reload` and `systemctl restart` keep it, and after `systemctl stop` the journal
has the grant and release with their structured fields. tests/boot/inside.sh is the
scenario; this file builds what it needs and checks what it leaves behind.

Needs root. The container root is built once (about a minute) and cached as a tarball under
$VACCEL_BOOT_CACHE (default /var/cache/vaccel-boot-test); later runs take seconds. It skips
only when a package index cannot be reached, and then says so loudly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BOOT = REPO / "tests" / "boot"
CACHE = Path(os.environ.get("VACCEL_BOOT_CACHE", "/var/cache/vaccel-boot-test"))
UNREACHABLE = 3  # build_root.sh's exit status for "the mirror cannot be reached"
STEPS = ["system-up", "install-project", "install-units", "configure", "start", "lease",
         "reload", "reload-invalid", "restart", "release", "stop"]

pytestmark = [pytest.mark.boot, pytest.mark.timeout(900)]


def loud_skip(what: str, detail: str) -> None:
    banner = "!" * 72
    message = (f"BOOT TEST NOT RUN: {what} cannot be reached, so the systemd service was "
               f"NOT tested. {detail.strip()[-600:]}")
    print(f"\n{banner}\n{message}\n{banner}", file=sys.stderr)
    pytest.skip(message)


def container_root() -> Path:
    result = subprocess.run(["bash", str(BOOT / "build_root.sh"), str(CACHE)],
                            capture_output=True, text=True, timeout=900)
    if result.returncode == UNREACHABLE:
        loud_skip("the Debian package mirror", result.stderr)
    assert result.returncode == 0, f"building the container root failed:\n{result.stderr}"
    return Path(result.stdout.strip().splitlines()[-1])


def dependency_wheels() -> Path:
    """Wheels of the project's dependencies, cached per dependency list (same CPython 3.11
    and glibc platform as the container's python3)."""
    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    key = hashlib.sha256(json.dumps([sys.version_info[:2], requirements]).encode()).hexdigest()
    wheels = CACHE / f"wheels-{key[:12]}"
    if not (wheels / ".complete").exists():
        partial = Path(f"{wheels}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
             "--dest", str(partial), *requirements],
            capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            offline = ("NewConnectionError", "Could not fetch URL", "Network is unreachable",
                       "Temporary failure in name resolution")
            if any(sign in result.stderr for sign in offline):
                loud_skip("the Python package index", result.stderr)
            pytest.fail(f"downloading the dependencies failed:\n{result.stderr}")
        (partial / ".complete").touch()
        shutil.rmtree(wheels, ignore_errors=True)
        partial.rename(wheels)
    return wheels


def project_wheel(tmp_path: Path) -> Path:
    """The project as a wheel, built from a copy of the working tree (never in place, so a
    stale build/ directory cannot leak removed modules into it)."""
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis",
        ".venv", ".cache"))
    dest = tmp_path / "project-wheel"
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
               str(dest), str(source)]
    if importlib.util.find_spec("setuptools") is not None:
        command.insert(-1, "--no-build-isolation")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"building the project wheel failed:\n{result.stderr}"
    (wheel,) = dest.glob("vaccel-*.whl")
    return wheel


def journal_entries(path: Path) -> list[dict[str, object]]:
    entries = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            entries.append(json.loads(line))
    return entries


def report(out: Path, timings: dict[str, float]) -> str:
    lines = [f"{name}: {seconds:.1f}s" for name, seconds in timings.items()]
    for name in ("boot.txt", "steps.log", "install.txt", "installed-from.txt", "version.txt", "system-state.txt",
                 "props-started.txt",
                 "props-stopped.txt", "client.out", "client.err", "journal.txt"):
        path = out / name
        if path.exists():
            lines.append(f"--- {name}\n{path.read_text().rstrip()}")
    return "\n".join(lines)


@pytest.mark.skipif(os.geteuid() != 0, reason="boots a container: needs root")
def test_broker_runs_as_a_systemd_service(tmp_path: Path) -> None:
    timings: dict[str, float] = {}
    started = time.monotonic()
    root = container_root()
    timings["container root"] = time.monotonic() - started

    started = time.monotonic()
    wheelhouse = tmp_path / "wheelhouse"
    shutil.copytree(dependency_wheels(), wheelhouse)
    shutil.copy2(project_wheel(tmp_path), wheelhouse)
    timings["wheelhouse"] = time.monotonic() - started

    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    boot = subprocess.run(["bash", str(BOOT / "boot.sh"), str(root), str(wheelhouse), str(out),
                           "300"], capture_output=True, text=True, timeout=420)
    timings["boot + scenario + poweroff"] = time.monotonic() - started
    summary = report(out, timings)
    print(summary)

    console = (out / "console.log").read_text() if (out / "console.log").exists() else ""
    assert boot.returncode == 0, f"{boot.stderr}\n{console[-4000:]}\n{summary}"
    steps = (out / "steps.log").read_text().splitlines()
    passed = [line.split()[1] for line in steps if line.startswith("ok ")]
    scenario = (out / "scenario.log").read_text() if (out / "scenario.log").exists() else ""
    assert passed == STEPS, f"{summary}\n--- scenario.log\n{scenario[-6000:]}"
    assert steps[-1] == "done 0"

    lease_id = (out / "client.out").read_text().split()[0]
    assert lease_id
    # The lease the ordinary user held survived the reload (same broker process) and the
    # restart (a new process that restored it from disk).
    assert lease_id in (out / "leases-after-reload.json").read_text()
    assert (out / "mainpid-before.txt").read_text() == (out / "mainpid-after.txt").read_text()
    assert lease_id in (out / "leases-after-restart.json").read_text()
    started_props = (out / "props-started.txt").read_text()
    assert "NotifyAccess=main" in started_props
    assert "WatchdogUSec=30s" in started_props
    assert "StatusText=\n" not in started_props + "\n", "the broker sent no STATUS= line"

    # journalctl -u vaccel-brokerd shows the lease's lines with their structured fields.
    text = (out / "journal.txt").read_text()
    assert any("grant" in line and lease_id in line for line in text.splitlines()), text
    events = {(e.get("EVENT"), e.get("USER")) for e in journal_entries(out / "journal.json")
              if e.get("LEASE_ID") == lease_id}
    assert ("grant", "alice") in events, events
    assert ("restore", "alice") in events, events
    assert events & {("released", "alice"), ("exit", "alice")}, events
    assert any(e.get("EVENT") == "reload" for e in journal_entries(out / "journal.json"))
