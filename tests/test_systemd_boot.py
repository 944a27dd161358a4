"""The lab's service test: a real systemd as PID 1 of a container runs vaccel as a lab installs it.

The project is built into its Debian package here (scripts/build_deb.sh, `make deb`, from
dependency wheels cached per dependency list) and, inside a systemd-nspawn container booted
from a debootstrap'd Debian 12 root, installed with `apt install ./vaccel_*.deb`, offline.
tests/boot/inside.sh is the scenario: the service starts, an ordinary user runs `vaccel
status` and `vaccel run`; with [web], [metrics], [enforce] mode = "acl" and the job mapping
turned on, the running unit refuses each with one journal line naming the setting, the
drop-in ExecReload= wrote grants them after a restart, both servers answer, a user's process
holding an unleased simulated node makes its device busy naming the holder, the ACL opens a
leased node to its holder only, the job mapping writes its file; reload and restart keep a
lease; an upgrade keeps a lease, a reservation and a queued request; remove keeps state and
config, purge removes them. This file builds what it needs and checks what it leaves behind.

Needs root. The container root is built once (about a minute) and cached as a tarball under
$VACCEL_BOOT_CACHE (default /var/cache/vaccel-boot-test), the dependency wheels beside it;
later runs spend their time building the package and running the scenario. It skips only when
a package index cannot be reached, and then says so loudly.
"""

from __future__ import annotations

import hashlib
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
STEPS = ["system-up", "install-package", "installed", "client-wheel", "configure", "hold-before", "reload-refuses",
         "restart-granted", "web-metrics", "delegate-needs", "enforce-busy", "lease", "job-mapping",
         "reserve-and-queue", "reload", "reload-invalid", "restart", "upgrade", "release", "stop", "remove", "purge",
         "make-install"]
EXTRAS = ("nvidia", "amd", "enforce")  # what the package puts in its venv (scripts/build_deb.sh)

pytestmark = [pytest.mark.boot, pytest.mark.timeout(1500)]


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
    """Wheels of the project's dependencies and of the extras the package carries, cached per
    dependency list (same CPython 3.11 and glibc platform as the container's python3)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"],
                    *(r for extra in EXTRAS for r in project["optional-dependencies"][extra])]
    key = hashlib.sha256(json.dumps([sys.version_info[:2], requirements]).encode()).hexdigest()
    wheels = CACHE / f"wheels-{key[:12]}"
    if not (wheels / ".complete").exists():
        partial = Path(f"{wheels}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        # `pip wheel`, not download: pylibacl comes as source only and is built here.
        result = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--use-pep517", "--wheel-dir", str(partial),
             *requirements], capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            offline = ("NewConnectionError", "Could not fetch URL", "Network is unreachable",
                       "Temporary failure in name resolution")
            if any(sign in result.stderr for sign in offline):
                loud_skip("the Python package index", result.stderr)
            pytest.fail(f"building the dependencies' wheels failed:\n{result.stderr}")
        (partial / ".complete").touch()
        shutil.rmtree(wheels, ignore_errors=True)
        partial.rename(wheels)
    return wheels


def packages(tmp_path: Path, wheels: Path) -> Path:
    """`make deb` of this checkout, and the same package as a newer version for the upgrade."""
    debs = tmp_path / "debs"
    result = subprocess.run(["bash", str(REPO / "scripts" / "build_deb.sh"), "--wheels", str(wheels),
                             "--out", str(debs)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"make deb failed:\n{result.stderr[-4000:]}"
    deb = Path(result.stdout.strip().splitlines()[-1])
    tree = tmp_path / "upgrade"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True, timeout=300)
    control = tree / "DEBIAN" / "control"
    version = next(line.split()[1] for line in control.read_text().splitlines() if line.startswith("Version:"))
    control.write_text(control.read_text().replace(f"Version: {version}", f"Version: {version}+boot1"))
    newer = debs / deb.name.replace(f"_{version}_", f"_{version}+boot1_")
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Znone", "--build", str(tree), str(newer)],
                   check=True, capture_output=True, timeout=300)
    # For `make install` after the purge: the same wheels, offline (scripts/install.sh --wheels).
    shutil.copytree(wheels, debs / "wheels")
    (project,) = debs.glob("vaccel-*.whl")  # the whole project's, beside the package
    project.rename(debs / "wheels" / project.name)
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    (tmp_path / "contents.txt").write_text(listing)
    return debs


def journal_entries(path: Path) -> list[dict[str, object]]:
    entries = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            entries.append(json.loads(line))
    return entries


def report(out: Path, timings: dict[str, float]) -> str:
    lines = [f"{name}: {seconds:.1f}s" for name, seconds in timings.items()]
    for name in ("boot.txt", "steps.log", "version.txt", "system-state.txt", "probe.txt", "refusals.txt",
                 "dropin.conf", "props-features.txt", "web-metrics.txt", "delegate-bare.txt", "delegate-granted.txt",
                 "status-busy.txt", "job-mapping.txt",
                 "props-stopped.txt", "client.out", "client.err", "journal.txt"):
        path = out / name
        if path.exists():
            lines.append(f"--- {name}\n{path.read_text().rstrip()}")
    return "\n".join(lines)


@pytest.mark.skipif(os.geteuid() != 0, reason="boots a container: needs root")
def test_the_package_runs_every_feature_under_the_shipped_unit(tmp_path: Path) -> None:
    timings: dict[str, float] = {}
    started = time.monotonic()
    root = container_root()
    timings["container root"] = time.monotonic() - started

    started = time.monotonic()
    wheels = dependency_wheels()
    timings["dependency wheels"] = time.monotonic() - started
    started = time.monotonic()
    debs = packages(tmp_path, wheels)
    timings["make deb (+ the upgrade's repack)"] = time.monotonic() - started

    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    boot = subprocess.run(["bash", str(BOOT / "boot.sh"), str(root), str(debs), str(out), "600"],
                          capture_output=True, text=True, timeout=720)
    timings["boot + scenario + poweroff"] = time.monotonic() - started
    summary = report(out, timings)
    print(summary)
    (deb,) = [d for d in debs.glob("*.deb") if "+boot1" not in d.name]
    print(f"--- package {deb.name}: {deb.stat().st_size} bytes")

    console = (out / "console.log").read_text() if (out / "console.log").exists() else ""
    assert boot.returncode == 0, f"{boot.stderr}\n{console[-4000:]}\n{summary}"
    steps = (out / "steps.log").read_text().splitlines()
    passed = [line.split()[1] for line in steps if line.startswith("ok ")]
    scenario = (out / "scenario.log").read_text() if (out / "scenario.log").exists() else ""
    assert passed == STEPS, f"{summary}\n--- scenario.log\n{scenario[-6000:]}"
    assert steps[-1] == "done 0"

    lease_id = (out / "client.out").read_text().split()[0]
    assert lease_id
    # The lease the ordinary user held survived the reload (same broker process), the
    # restart and the upgrade (new processes that restored it from disk).
    assert lease_id in (out / "leases-after-reload.json").read_text()
    assert (out / "mainpid-before.txt").read_text() == (out / "mainpid-after.txt").read_text()
    assert lease_id in (out / "leases-after-restart.json").read_text()
    assert lease_id in (out / "leases-after-upgrade.json").read_text()
    assert (out / "queued.rc").read_text().strip() == "0"  # bob's request, queued across the upgrade, ran
    # Under the drop-in the unit grants exactly what the features need.
    props = (out / "props-features.txt").read_text()
    assert "PrivateNetwork=no" in props and "cap_sys_ptrace" in props and "AF_INET" in props, props

    # journalctl -u vaccel-brokerd shows the lease's lines with their structured fields.
    text = (out / "journal.txt").read_text()
    assert any("grant" in line and lease_id in line for line in text.splitlines()), text
    entries = journal_entries(out / "journal.json")
    events = {(e.get("EVENT"), e.get("USER")) for e in entries if e.get("LEASE_ID") == lease_id}
    assert ("grant", "alice") in events, events
    assert ("restore", "alice") in events, events
    assert events & {("released", "alice"), ("exit", "alice")}, events
    assert any(e.get("EVENT") == "reload" for e in entries)
    refused = {(e.get("FEATURE"), e.get("SETTING")) for e in entries if e.get("EVENT") == "unit"}
    assert refused == {("web.listen", "RestrictAddressFamilies="), ("metrics.listen", "RestrictAddressFamilies="),
                       ("enforce.mode", "CapabilityBoundingSet="),
                       ("metrics.hpc_job_mapping_dir", "ReadWritePaths=")}, refused
