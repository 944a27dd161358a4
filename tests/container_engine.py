"""Real container engines for the tests, each started privately from the measured recipe
in ../shared/notes/containers.md (docs/containers.md says what each enforces):

    engine = DockerEngine(Path(tempfile.mkdtemp(prefix="vct-", dir="/tmp")))
    engine.start()                       # a private dockerd; raises EngineStartError with its log
    engine.import_image()                # the host-/usr image, offline, in well under a second
    engine.docker("run", "--rm", *engine.image_args(), "true")
    engine.stop()                        # no container, process or mount of it left

- Docker: Debian's docker.io, always /usr/bin/docker (/usr/local/bin/docker on these machines is
  another program), with its own socket, data root and exec root under a temp folder; never
  /var/run/docker.sock. No bridge and no iptables: containers run with `--network none`.
- The image borrows the host's merged /usr read-only (`-v /usr:/usr:ro`, see `image_args`): no
  registry, no download, the host's own python3 and the test venv (mounted at its own path).
- Rootless podman: a real Unix user with an /etc/subuid range, its own HOME, XDG_RUNTIME_DIR,
  containers.conf and overlay storage under the temp folder; runc, cgroupfs (cgroup v1 here:
  rootless containers get no cgroup of their own), and the podman pause process stopped by its pid.

Everything started is stopped by the pid we hold or read from the engine's own pid file; nothing
is looked up by name. Session fixtures `docker_engine` and `rootless_podman` (below, registered in
tests/conftest.py so that there is one of each for the whole run) start each engine when first asked.
"""

from __future__ import annotations

import io
import os
import pwd
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

DOCKER = "/usr/bin/docker"
DOCKERD = "/usr/sbin/dockerd"
PODMAN = "/usr/bin/podman"
IMAGE = "vaccel-hostusr:latest"
PODMAN_IMAGE = f"localhost/{IMAGE}"
ROOTLESS_USER = "vaccel-ctuser"


class EngineStartError(RuntimeError):
    """The engine did not come up; the message carries its log."""


def missing_programs(*programs: str) -> list[str]:
    """Which of the engines' programs this machine lacks (scripts/setup.sh installs them)."""
    return [p for p in programs if not os.access(p, os.X_OK)]


def image_tar() -> bytes:
    """The image's whole filesystem: an empty skeleton whose bin and lib point into /usr,
    which every container gets from the host read-only. Made in memory, numeric owners."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        def add(name: str, kind: bytes = tarfile.DIRTYPE, mode: int = 0o755, data: bytes = b"",
                target: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.size, info.linkname = kind, mode, len(data), target
            tar.addfile(info, io.BytesIO(data) if data else None)

        # sbin is a folder of its own: docker's --init mounts its init at /sbin/docker-init,
        # which cannot be made inside the read-only /usr (the host's sbin stays in PATH as /usr/sbin).
        for folder in ("usr", "etc", "proc", "sys", "dev", "run", "root", "sbin"):
            add(folder)
        add("tmp", mode=0o1777)
        for link in ("bin", "lib", "lib64"):
            add(link, tarfile.SYMTYPE, 0o777, target=f"usr/{link}")
        add("etc/passwd", tarfile.REGTYPE, 0o644,
            b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        add("etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\nnogroup:x:65534:\n")
    return out.getvalue()


def image_args() -> list[str]:
    """What every `run` of the image needs: the host's /usr, read-only; no network."""
    return ["--network", "none", "-v", "/usr:/usr:ro"]


def _mounts_under(base: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(f"{base}/")]


def _processes_under(base: Path) -> list[int]:
    """Pids whose command line names the engine's folder (dockerd's containerd, its shims):
    the engine's own helpers, started by us. Used to check, and to clean up after a failure."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if str(base).encode() + b"/" in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


class DockerEngine:
    """One private dockerd. `host` (unix://...) and `env` are what a docker client needs."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.socket = base / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.log = base / "dockerd.log"
        self.env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "DOCKER_HOST": self.host, "HOME": str(base),
                    "DOCKER_CONFIG": str(base / "client")}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> DockerEngine:
        for folder in ("data", "exec", "client"):
            (self.base / folder).mkdir(parents=True, exist_ok=True)
        command = [DOCKERD, "--host", self.host, "--data-root", str(self.base / "data"),
                   "--exec-root", str(self.base / "exec"), "--pidfile", str(self.base / "dockerd.pid"),
                   "--iptables=false", "--ip-masq=false", "--bridge=none", "--storage-driver=overlay2",
                   "--exec-opt", "native.cgroupdriver=cgroupfs"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineStartError(f"dockerd exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if self.docker("version", "--format", "{{.Server.Version}}", timeout=10).returncode == 0:
                return self
            time.sleep(0.1)
        raise EngineStartError(f"dockerd did not answer in {timeout}s:\n{self.log.read_text()}")

    def docker(self, *args: str, timeout: float = 60, check: bool = False,
               input: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run Debian's docker client against this daemon (text output)."""
        r = subprocess.run([DOCKER, *args], env=self.env, input=input, capture_output=True, timeout=timeout)
        done = subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(errors="replace"),
                                           r.stderr.decode(errors="replace"))
        if check and done.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def import_image(self) -> str:
        self.docker("import", "--change", 'CMD ["/bin/sh"]', "-", IMAGE, input=image_tar(), check=True)
        return IMAGE

    def image_args(self) -> list[str]:
        return image_args()

    def inspect(self, container: str, template: str) -> str:
        return self.docker("inspect", "--format", template, container, check=True).stdout.strip()

    def stop(self, timeout: float = 30.0) -> None:
        """Remove every container, stop dockerd (it stops its containerd), check that nothing
        of it is left, remove the folder."""
        if self.proc is not None and self.proc.poll() is None:
            ids = self.docker("ps", "-aq", timeout=30).stdout.split()
            if ids:
                self.docker("rm", "-f", *ids, timeout=60)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = _processes_under(self.base)
        for pid in left:  # only after a failure: dockerd stops its own helpers
            os.kill(pid, signal.SIGKILL)
        mounts = _mounts_under(self.base)
        for mount in reversed(mounts):
            subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(self.base, ignore_errors=True)
        if left or mounts:
            raise AssertionError(f"dockerd left processes {left} and mounts {mounts}")


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
        # default_ulimits = []: runc cannot raise the nofile limit podman asks for by default here.
        (self.base / "containers.conf").write_text(
            f'[containers]\nnetns = "none"\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\n'
            f'events_logger = "file"\nevents_logfile_path = "{self.base}/tmp/events.log"\nruntime = "runc"\n'
            f'tmp_dir = "{self.base}/tmp"\n')
        # overlay, not the default vfs: a run takes ~1 s instead of ~10 s
        (self.base / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{self.base}/storage"\nrunroot = "{self.base}/runroot"\n')
        for conf in ("containers.conf", "storage.conf"):
            os.chmod(self.base / conf, 0o644)
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
                _wait_gone(pid, 10)
        left = _processes_under(self.base)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)
        if left:
            raise AssertionError(f"rootless podman left processes {left}")


def _engine_folder(prefix: str) -> Path:
    # directly under /tmp: a Unix socket path must stay under 108 bytes
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


@pytest.fixture(scope="session", name="docker_engine")
def docker_engine_fixture() -> Iterator[DockerEngine]:
    """A private dockerd with the host-/usr image imported, for the whole test run."""
    if os.geteuid() != 0:
        pytest.skip("a private dockerd needs root")
    missing = missing_programs(DOCKERD, DOCKER)
    if missing:
        pytest.skip(f"missing {', '.join(missing)}: run scripts/setup.sh as root")
    engine = DockerEngine(_engine_folder("vct-d-"))
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
    engine = RootlessPodman(_engine_folder("vct-p-")).start()
    try:
        engine.import_image()
    except BaseException:
        engine.stop()
        raise
    yield engine
    engine.stop()
