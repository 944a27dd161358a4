"""Real container engines for the tests, each started privately from the measured recipe
in ../shared/notes/containers.md (docs/containers.md says what each enforces):

    engine = DockerEngine(engine_folder("vct-d-"))
    engine.start()                       # a private dockerd; raises EngineStartError with its log
    engine.import_image()                # the host-/usr image, offline, in well under a second
    engine.docker("run", "--rm", *engine.image_args(), "true")
    engine.stop()                        # no container, process or mount of it left

- Docker: Debian's docker.io, always /usr/bin/docker (/usr/local/bin/docker on these machines is
  another program), with its own socket, data root and exec root under a temp folder; never
  /var/run/docker.sock. No bridge and no iptables: containers run with `--network none`.
- The image borrows the host's merged /usr read-only (`-v /usr:/usr:ro`, see `image_args`): no
  registry, no download, the host's own python3 and the test venv (mounted at its own path).
- Podman, rootful (its API on a private socket) and rootless (a real user): tests/podman_engine.py.

Everything started is stopped by the pid we hold or read from the engine's own pid file; nothing
is looked up by name. The session fixtures `docker_engine` (below), `rootful_podman` and
`rootless_podman` (tests/podman_engine.py) are registered in tests/conftest.py, so that there is
one of each for the whole run, started when a test first asks for it.
"""

from __future__ import annotations

import io
import os
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


def mounts_under(base: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(f"{base}/")]


def processes_under(base: Path) -> list[int]:
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


def wait_gone(pid: int, timeout: float) -> bool:
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
        left = processes_under(self.base)
        for pid in left:  # only after a failure: dockerd stops its own helpers
            os.kill(pid, signal.SIGKILL)
        mounts = mounts_under(self.base)
        for mount in reversed(mounts):
            subprocess.run(["umount", "-l", mount], check=False)
        # On a loaded machine the engine's last helpers may still be writing there as they
        # exit: remove the folder until it is gone (an event, not a pause), for a while.
        deadline = time.monotonic() + timeout
        shutil.rmtree(self.base, ignore_errors=True)
        while self.base.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
            shutil.rmtree(self.base, ignore_errors=True)
        if left or mounts:
            raise AssertionError(f"dockerd left processes {left} and mounts {mounts}")


def engine_folder(prefix: str) -> Path:
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
    engine = DockerEngine(engine_folder("vct-d-"))
    try:
        engine.start()
        engine.import_image()
    except BaseException:
        engine.stop()
        raise
    yield engine
    engine.stop()
