"""Podman for the tests, rootful (its Docker-compatible API on a private socket) and rootless
(a real user with a subuid range), from the measured recipe in ../shared/notes/containers.md;
tests/container_engine.py has the rest (the image, dockerd, the clean-up checks).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.container_engine import (
    PODMAN,
    PODMAN_IMAGE,
    EngineStartError,
    engine_folder,
    image_args,
    image_tar,
    missing_programs,
    mounts_under,
    processes_under,
    wait_gone,
)

ROOTLESS_USER = "vaccel-ctuser"


def write_podman_config(base: Path) -> dict[str, str]:
    """containers.conf and storage.conf for a podman whose state all lives under `base` (which
    must hold the folders storage, runroot and tmp); the environment that selects them."""
    # default_ulimits = []: runc cannot raise the nofile limit podman asks for by default here.
    (base / "containers.conf").write_text(
        f'[containers]\nnetns = "none"\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\n'
        f'events_logger = "file"\nevents_logfile_path = "{base}/tmp/events.log"\nruntime = "runc"\n'
        f'tmp_dir = "{base}/tmp"\n')
    # overlay, not the default vfs: a run takes ~1 s instead of ~10 s
    (base / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{base}/storage"\nrunroot = "{base}/runroot"\n')
    for conf in ("containers.conf", "storage.conf"):
        os.chmod(base / conf, 0o644)
    return {"CONTAINERS_CONF": str(base / "containers.conf"), "CONTAINERS_STORAGE_CONF": str(base / "storage.conf")}


class RootfulPodman:
    """Podman as root with its Docker-compatible API served on a private socket
    (`podman system service`), all its state under `base`."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.socket = base / "podman.sock"
        self.host = f"unix://{self.socket}"
        self.env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(base)}
        self.service: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> RootfulPodman:
        for folder in ("storage", "runroot", "tmp"):
            (self.base / folder).mkdir(mode=0o700, exist_ok=True)
        self.env.update(write_podman_config(self.base))
        with (self.base / "service.log").open("ab") as log:
            self.service = subprocess.Popen([PODMAN, "system", "service", "--time=0", self.host], env=self.env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.service.poll() is not None:
                raise EngineStartError(f"podman system service exited with {self.service.returncode}:\n"
                                       f"{(self.base / 'service.log').read_text()}")
            if self.socket.exists():
                return self
            time.sleep(0.05)
        raise EngineStartError(f"podman system service made no socket in {timeout}s")

    def podman(self, *args: str, timeout: float = 60, check: bool = False,
               input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([PODMAN, *args], env=self.env, input=input, capture_output=True, timeout=timeout)
        done = subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(errors="replace"),
                                           r.stderr.decode(errors="replace"))
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def import_image(self) -> str:
        self.podman("import", "--change", 'CMD ["/bin/sh"]', "-", PODMAN_IMAGE, input=image_tar(), check=True)
        return PODMAN_IMAGE

    def image_args(self) -> list[str]:
        return image_args()

    def inspect(self, container: str, template: str) -> str:
        return self.podman("inspect", "--format", template, container, check=True).stdout.strip()

    def stop(self) -> None:
        """Remove every container, stop the API service, check nothing of it is left."""
        self.podman("rm", "-af", "-t", "0", timeout=60)
        if self.service is not None and self.service.poll() is None:
            self.service.send_signal(signal.SIGTERM)
            try:
                self.service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait()
        left = processes_under(self.base)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        mounts = mounts_under(self.base)
        for mount in reversed(mounts):
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.base, ignore_errors=True)
        if left or mounts:
            raise AssertionError(f"rootful podman left processes {left} and mounts {mounts}")


def ensure_rootless_user(name: str = ROOTLESS_USER) -> pwd.struct_passwd:
    """A real user with a subordinate id range (rootless podman maps the container's ids into it)."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        entry = pwd.getpwnam(name)
    for table, flag in (("/etc/subuid", "--add-subuids"), ("/etc/subgid", "--add-subgids")):
        lines = Path(table).read_text().splitlines() if Path(table).exists() else []
        if not any(line.split(":")[0] == name for line in lines):
            # useradd adds one where login.defs says so; otherwise a range after every other one
            end = max((int(s) + int(c) for _, s, c in (line.split(":") for line in lines if line)), default=100000)
            subprocess.run(["usermod", flag, f"{end}-{end + 65535}", name], check=True)
    return entry


class RootlessPodman:
    """Podman run by an unprivileged user, all its state under `base`."""

    def __init__(self, base: Path, user: str = ROOTLESS_USER) -> None:
        self.base = base
        self.user = pwd.getpwnam(user)
        self.env = {"PATH": "/usr/bin:/bin", "HOME": str(base / "home"), "XDG_RUNTIME_DIR": str(base / "run"),
                    "CONTAINERS_CONF": str(base / "containers.conf"),
                    "CONTAINERS_STORAGE_CONF": str(base / "storage.conf")}

    def start(self) -> RootlessPodman:
        os.chmod(self.base, 0o755)
        for folder in ("home", "run", "storage", "runroot", "tmp"):
            path = self.base / folder
            path.mkdir(mode=0o700, exist_ok=True)
            os.chown(path, self.user.pw_uid, self.user.pw_gid)
        write_podman_config(self.base)
        return self

    def podman(self, *args: str, timeout: float = 60, check: bool = False,
               input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run podman as the user."""
        done = self.run_as_user([PODMAN, *args], timeout=timeout, input=input)
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def run_as_user(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 120,
                    input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command as the user, with its own groups only and this podman's environment
        (or `env`); text output, podman's '"/" is not a shared mount' warning dropped."""
        r = subprocess.run(argv, user=self.user.pw_uid, group=self.user.pw_gid, extra_groups=[],
                           env=self.env if env is None else env, cwd="/", input=input, capture_output=True,
                           timeout=timeout)
        stderr = "\n".join(line for line in r.stderr.decode(errors="replace").splitlines()
                           if "is not a shared mount" not in line)
        return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(errors="replace"), stderr)

    def import_image(self) -> str:
        self.podman("import", "--change", 'CMD ["/bin/sh"]', "-", PODMAN_IMAGE, input=image_tar(), check=True)
        return PODMAN_IMAGE

    def image_args(self) -> list[str]:
        return image_args()

    def inspect(self, container: str, template: str) -> str:
        return self.podman("inspect", "--format", template, container, check=True).stdout.strip()

    def stop(self) -> None:
        """Remove every container, stop the user's pause process (it holds the user namespace the
        containers shared), remove the folder."""
        self.podman("rm", "-af", "-t", "0", timeout=60)
        pause = self.base / "tmp" / "pause.pid"
        if pause.exists():
            pid = int(pause.read_text().strip())
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            else:
                wait_gone(pid, 10)
        left = processes_under(self.base)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)
        if left:
            raise AssertionError(f"rootless podman left processes {left}")



@pytest.fixture(scope="session", name="rootful_podman")
def rootful_podman_fixture() -> Iterator[RootfulPodman]:
    """Podman as root with its API service on a private socket, the host-/usr image imported."""
    if os.geteuid() != 0:
        pytest.skip("rootful podman needs root")
    missing = missing_programs(PODMAN)
    if missing:
        pytest.skip(f"missing {', '.join(missing)}: run scripts/setup.sh as root")
    engine = RootfulPodman(engine_folder("vct-r-"))
    try:
        engine.start()
        engine.import_image()
    except BaseException:
        engine.stop()
        raise
    yield engine
    engine.stop()


@pytest.fixture(scope="session", name="rootless_podman")
def rootless_podman_fixture() -> Iterator[RootlessPodman]:
    """Podman as the unprivileged user vaccel-ctuser, with the host-/usr image imported."""
    if os.geteuid() != 0:
        pytest.skip("creating the rootless podman user needs root")
    missing = missing_programs(PODMAN, "/usr/bin/newuidmap")
    if missing:
        pytest.skip(f"missing {', '.join(missing)}: run scripts/setup.sh as root")
    ensure_rootless_user()
    engine = RootlessPodman(engine_folder("vct-p-")).start()
    try:
        engine.import_image()
    except BaseException:
        engine.stop()
        raise
    yield engine
    engine.stop()
