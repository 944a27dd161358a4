"""Accounting and fair share for the single-node Slurm (bench/testbeds/slurm.py), as a lab
that shares GPUs among people runs it: slurmdbd on a MariaDB of its own, one association
per person under one account with equal shares, priority/multifactor weighing fair share
(and age, so nobody starves), the partition billing GPUs rather than CPUs.

    accounting = Accounting(users=["alice", "bob"], half_life_min=8, max_age_min=2)
    cluster = SlurmCluster(folder, accounting=accounting)
    cluster.start()       # MariaDB, slurmdbd, the associations, then slurmctld and slurmd

The recipe (measured on these machines) is ../shared/notes/slurm-fairshare.md. The
database is private: its own data directory, socket and port under the cluster's folder,
started as the mysql user and stopped by its PID, touching nothing of the system's.
`users` must exist on this host (slurmdbd and slurmd look them up); the jobs are then
submitted under their uids (`SlurmCluster.as_user`). Debian packages: mariadb-server,
slurmdbd.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

ACCOUNT = "lab"
DAEMONS = ("mariadbd", "mariadb-install-db", "slurmdbd", "sacctmgr", "sshare")


def missing_programs() -> list[str]:
    return [p for p in DAEMONS if shutil.which(p) is None]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Accounting:
    """What a cluster needs for fair share. `half_life_min` and `max_age_min`: Slurm's
    PriorityDecayHalfLife and PriorityMaxAge in real minutes (scale them with any time
    compression; 1 is the least Slurm takes). `user_gpus`: a per-user cap on GPUs held at
    once through the QOS every association uses (0: none), as vaccel's max_devices."""

    def __init__(self, users: Sequence[str], *, half_life_min: int = 7 * 24 * 60, max_age_min: int = 7 * 24 * 60,
                 user_gpus: int = 0) -> None:
        self.users = list(users)
        self.half_life_min = max(1, half_life_min)
        self.max_age_min = max(1, max_age_min)
        self.user_gpus = user_gpus
        self.db_port = self.dbd_port = 0

    def slurm_conf(self, munge_socket: Path) -> str:
        """The slurm.conf lines (they replace `AccountingStorageType=accounting_storage/none`)."""
        enforce = "associations,limits,qos" if self.user_gpus else "associations"
        return (f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
                f"AccountingStoragePort={self.dbd_port}\nAccountingStoragePass={munge_socket}\n"
                f"AccountingStorageEnforce={enforce}\nAccountingStorageTRES=gres/gpu\n"
                "PriorityType=priority/multifactor\nPriorityWeightFairshare=10000\nPriorityWeightAge=1000\n"
                f"PriorityDecayHalfLife={self.half_life_min}\nPriorityMaxAge={self.max_age_min}\n"
                "PriorityCalcPeriod=1\n")

    @staticmethod
    def partition() -> str:
        """The partition bills GPUs, not CPUs: fair share counts what the lab shares."""
        return "TRESBillingWeights=CPU=0,GRES/gpu=1"

    def start(self, root: Path, node: str, cluster_name: str, munge_socket: Path,
              spawn: Callable[[str, list[str]], None], until: Callable[[str, Callable[[], bool]], None],
              env: dict[str, str]) -> None:
        """MariaDB, then slurmdbd, then the cluster, account and users: before slurmctld,
        which registers with slurmdbd as it starts."""
        db = root / "db"
        done = subprocess.run(["mariadb-install-db", "--user=mysql", f"--datadir={db}", "--skip-test-db",
                               "--auth-root-authentication-method=socket"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"mariadb-install-db failed: {done.stderr[-2000:]}")
        sock = db / "s.sock"
        spawn("mariadbd", ["mariadbd", "--user=mysql", f"--datadir={db}", f"--socket={sock}",
                           f"--port={self.db_port}", "--bind-address=127.0.0.1", f"--pid-file={db}/mariadbd.pid",
                           "--skip-name-resolve", "--innodb-buffer-pool-size=32M"])
        until("MariaDB to accept connections", lambda: _port_open(self.db_port))
        password = secrets.token_hex(12)
        sql = (f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
               "GRANT ALL ON *.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;")
        done = subprocess.run(["mariadb", f"--socket={sock}", "-u", "root", "-e", sql],
                              capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise RuntimeError(f"could not make the database user: {done.stderr[-2000:]}")
        conf = root / "etc" / "slurmdbd.conf"
        conf.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={munge_socket}
DbdAddr=127.0.0.1
DbdHost={node}
DbdPort={self.dbd_port}
SlurmUser=root
PidFile={root}/run/slurmdbd.pid
LogFile={root}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.db_port}
StorageUser=slurm
StoragePass={password}
StorageLoc=slurm_acct_{cluster_name.replace('-', '_')}
""")
        conf.chmod(0o600)
        # slurmdbd reads slurmdbd.conf beside the slurm.conf that SLURM_CONF names.
        spawn("slurmdbd", ["slurmdbd", "-D"])
        until("slurmdbd to accept connections", lambda: _port_open(self.dbd_port))
        self._associations(cluster_name, env)

    def _associations(self, cluster_name: str, env: dict[str, str]) -> None:
        def sacctmgr(*args: str) -> None:
            done = subprocess.run(["sacctmgr", "-i", *args], capture_output=True, text=True, timeout=60, env=env)
            if done.returncode and "Nothing new added" not in done.stdout + done.stderr:
                raise RuntimeError(f"sacctmgr {' '.join(args)}: {done.stdout}{done.stderr}")

        missing = [u for u in self.users if not _known(u)]
        if missing:
            raise RuntimeError(f"no such user(s) on this host: {', '.join(missing)}")
        sacctmgr("add", "cluster", cluster_name)
        sacctmgr("add", "account", ACCOUNT, f"Cluster={cluster_name}")
        for start in range(0, len(self.users), 50):
            sacctmgr("add", "user", ",".join(self.users[start:start + 50]), f"Account={ACCOUNT}",
                     f"Cluster={cluster_name}")

    def cap_users(self, env: dict[str, str]) -> None:
        """The per-user GPU cap through the QOS, once slurmctld has registered gres/gpu with
        slurmdbd (AccountingStorageTRES): before that the database knows no such TRES."""
        if not self.user_gpus:
            return
        done = subprocess.run(["sacctmgr", "-i", "modify", "qos", "normal", "set",
                               f"MaxTRESPerUser=gres/gpu={self.user_gpus}"],
                              capture_output=True, text=True, timeout=60, env=env)
        if done.returncode:
            raise RuntimeError(f"sacctmgr modify qos normal: {done.stdout}{done.stderr}")


def _known(user: str) -> bool:
    try:
        pwd.getpwnam(user)
        return True
    except KeyError:
        return False


def ensure_users(names: Sequence[str]) -> dict[str, int]:
    """Unix accounts for lab users (no home, no login), made when missing; name -> uid."""
    uids = {}
    for name in names:
        if not _known(name):
            done = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
                                  capture_output=True, text=True, timeout=60)
            if done.returncode:
                raise RuntimeError(f"useradd {name}: {done.stderr.strip()}")
        uids[name] = pwd.getpwnam(name).pw_uid
    return uids


def as_user_argv(uid: int, gid: int, argv: Sequence[str]) -> list[str]:
    """`argv` under the user's uid and gid and no other group, as that person runs it."""
    if os.geteuid() != 0:
        return list(argv)
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]
