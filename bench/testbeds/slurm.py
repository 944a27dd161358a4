"""A real single-node Slurm for the tests and the benchmarks (no pytest here: `bench.lab` runs
from an install without the test tools): munged, slurmctld and slurmd of Debian's slurm-wlm
(22.05), all on loopback in a folder of their own, with four fake GPUs as GRES.

    cluster = SlurmCluster(folder)
    cluster.start()                 # raises SlurmStartError with the daemons' logs
    subprocess.run(["srun", "--gres=gpu:1", "env"], env=cluster.env())
    cluster.stop()

The recipe (measured on these machines) is ../shared/notes/slurm-single-node.md. Why the
settings are what they are:
- the fake GPUs are character devices (slurmd rejects plain files), major 195 as the
  real driver's nodes have, so the gres plugin treats them as the GPUs it knows;
- `SlurmdParameters=config_overrides` with CPUs=8: the node declares more CPUs than the
  machine's two, so several one-GPU jobs run side by side;
- `Epilog=/bin/true`: with an epilog configured, slurmctld schedules a waiting job as soon
  as the previous one's epilog completes (~40 ms) instead of on its next periodic pass (1-3 s);
- munged runs as the munge user with its own key and socket, so no system munge is needed.
Everything is stopped by the PIDs we started; nothing is looked up by name.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from bench.testbeds.slurm_accounting import Accounting

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "sinfo", "scontrol", "squeue", "scancel")
FAKE_GPU_MAJOR = 195  # the major number of the real driver's device nodes
CLUSTER = "vaccel-test"


class SlurmStartError(RuntimeError):
    """The cluster did not come up; the message carries the daemons' logs."""


def missing_programs() -> list[str]:
    """The Slurm/munge programs this machine lacks (empty when a cluster can start)."""
    return [p for p in (*DAEMONS, *CLIENTS) if shutil.which(p) is None]


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    """One node (this host's short name) with `gpus` fake GPUs and `cpus` declared CPUs.
    `settings` are more slurm.conf lines (a benchmark's SchedulerParameters), `partition`
    the test partition's limits."""

    def __init__(self, root: Path, *, gpus: int = 4, cpus: int = 8, settings: str = "",
                 partition: str = "MaxTime=INFINITE", accounting: Accounting | None = None) -> None:
        self.root = Path(root)
        self.gpus = gpus
        self.cpus = cpus
        self.settings = settings
        self.partition = partition
        self.accounting = accounting  # fair share through slurmdbd (bench/testbeds/slurm_accounting.py)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "etc" / "slurm.conf"
        self.devices = [self.root / "dev" / f"nvidia{i}" for i in range(gpus)]
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- clients -----------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """An environment for Slurm's client commands: this cluster's SLURM_CONF, and no
        SLURM_* of an outer job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def run(self, *args: str, timeout: float = 30, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Run a client command (srun, sbatch, ...) against this cluster, bounded in time."""
        kwargs.setdefault("env", self.env())
        return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]

    # -- start -------------------------------------------------------------------------

    def start(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        try:
            self._write_files()
            self._start_munged(deadline)
            if self.accounting is not None:
                self.accounting.start(self.root, self.node, CLUSTER, self.root / "munge" / "munge.socket.2",
                                      self._spawn,
                                      lambda what, ready: self._until(deadline, what, ready), self.env())
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
            self._wait_idle(deadline)
            if self.accounting is not None:
                self.accounting.cap_users(self.env())
        except BaseException as err:
            logs = self.logs()
            self.stop()
            if isinstance(err, SlurmStartError):
                raise SlurmStartError(f"{err}\n{logs}") from None
            raise

    def _write_files(self) -> None:
        for sub in ("etc", "munge", "state", "spool", "log", "run", "dev"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged (as the munge user) must reach its folder through ours.
        for path in (self.root, *self.root.parents):
            if path == Path("/tmp") or path == Path("/"):
                break
            path.chmod(path.stat().st_mode | stat.S_IXOTH)
        munge = pwd.getpwnam("munge")
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        for path in (self.root / "munge", key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        key.chmod(0o400)
        # Open to every user (the key stays munge's alone): jobs are submitted as real users,
        # whose Slurm commands reach munged through its socket here.
        (self.root / "munge").chmod(0o755)
        for i, dev in enumerate(self.devices):
            if not dev.exists():
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(FAKE_GPU_MAJOR, i))
            dev.chmod(0o666)  # mknod's mode is masked by the umask
        ctld_port, slurmd_port, *accounting_ports = _free_ports(4 if self.accounting is not None else 2)
        r = self.root
        storage = "AccountingStorageType=accounting_storage/none"
        partition = self.partition
        if self.accounting is not None:
            self.accounting.db_port, self.accounting.dbd_port = accounting_ports
            storage = self.accounting.slurm_conf(r / "munge" / "munge.socket.2")
            partition = f"{partition} {self.accounting.partition()}"
        last = f"[0-{self.gpus - 1}]" if self.gpus > 1 else "0"
        self.conf.write_text(f"""\
ClusterName={CLUSTER}
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.socket.2
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
{storage}
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=2
InactiveLimit=0
KillWait=2
Epilog=/bin/true
{self.settings}
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=2000 Gres=gpu:{self.gpus} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES {partition} State=UP
""")
        (r / "etc" / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.node} Name=gpu File={r}/dev/nvidia{last}\n")

    def _start_munged(self, deadline: float) -> None:
        m = self.root / "munge"
        self._spawn("munged", [
            "setpriv", "--reuid=munge", "--regid=munge", "--init-groups",
            "munged", "-F", "--force", f"--socket={m}/munge.socket.2", f"--key-file={m}/munge.key",
            f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed",
        ])
        self._until(deadline, "munged to open its socket", lambda: (m / "munge.socket.2").exists())

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / "log" / f"{name}.out").open("wb")
        with log:
            self._procs[name] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env(), start_new_session=True)

    def _wait_idle(self, deadline: float) -> None:
        def idle() -> bool:
            r = self.run("sinfo", "-h", "-N", "-o", "%T", timeout=5)
            return r.returncode == 0 and r.stdout.strip() == "idle"

        self._until(deadline, f"sinfo to show node {self.node} idle", idle)

    def _until(self, deadline: float, what: str, ready: object) -> None:
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmStartError(f"{name} exited with status {proc.returncode} while waiting for {what}")
            if ready():  # type: ignore[operator]
                return
            if time.monotonic() > deadline:
                raise SlurmStartError(f"timed out waiting for {what}")
            time.sleep(0.1)

    # -- stop --------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel what is still queued or running, then end the daemons by their PIDs
        (slurmd first, munged last: the others need it to say goodbye)."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            try:
                self.cancel_all()
            except subprocess.TimeoutExpired:
                pass
        for name in ("slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def cancel_all(self, timeout: float = 10) -> None:
        """Cancel every job of every user (root may) and wait until none is left running."""
        self.run("scancel", "--quiet", "--partition=test", timeout=5)
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.run("squeue", "-h", timeout=5).stdout.strip():
            time.sleep(0.1)

    def logs(self) -> str:
        """Every daemon's log (and stdout), for a failure message."""
        parts = []
        for path in sorted([*(self.root / "log").glob("*"), self.root / "munge" / "munged.log"]):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            parts.append(f"--- {path.name} ---\n{text[-4000:]}")
        return "\n".join(parts)
