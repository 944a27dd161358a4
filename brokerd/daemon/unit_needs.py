"""What each feature the config turns on needs from the systemd unit, the drop-in that grants
exactly that, and the refusal of a feature the running unit blocks (issue 41).

The shipped unit (systemd/vaccel-brokerd.service) grants what every configuration needs:
CAP_KILL, Unix sockets, /run/vaccel and /var/lib/vaccel. `vaccel-brokerd write-unit-dropin`
writes DROPIN with what the features in /etc/vaccel/brokerd.toml need beyond that, one
commented block per feature; the package and `install-units` run it at install, and
`systemctl reload` runs it too (ExecReload=). A drop-in applies from the next `systemctl
daemon-reload` and start, so
the daemon checks at start and at reload whether its own confinement lets each feature
work (brokerd/base/confinement.py), and turns off one that it does not, with one journal
line naming the unit setting: never a dashboard "serving" in a network namespace nobody
else can reach.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from brokerd.base import confinement
from brokerd.base.journal import log_event
from brokerd.config.loader import Config

UNIT = "vaccel-brokerd.service"
DROPIN = Path("/etc/systemd/system") / f"{UNIT}.d" / "50-features.conf"
APPLY = "vaccel-brokerd write-unit-dropin && systemctl daemon-reload && systemctl restart vaccel-brokerd"
# What the shipped unit already lets write (RuntimeDirectory=, StateDirectory=).
UNIT_WRITES = (Path("/run/vaccel"), Path("/var/lib/vaccel"))


@dataclass(frozen=True)
class Need:
    feature: str  # the config key that turns it on
    why: str  # one line, for the drop-in's comment
    capabilities: tuple[str, ...] = ()
    families: tuple[str, ...] = ()
    network: bool = False  # the host's network namespace (PrivateNetwork=no)
    syscalls: tuple[str, ...] = ()  # system calls (and groups) the unit's ~@privileged removes
    writes: tuple[Path, ...] = ()
    off: dict[str, object] = dataclasses.field(default_factory=dict)  # the Config fields that turn it off


def _outside_unit(path: Path) -> bool:
    return not any(path == base or base in path.parents for base in UNIT_WRITES)


def needs(config: Config) -> list[Need]:
    """What the features `config` turns on need beyond the shipped unit, one Need each."""
    found: list[Need] = []
    inet = ("AF_INET", "AF_INET6")
    # AF_NETLINK: a local client's uid comes from sock_diag (brokerd/base/tcp_peer.py), which
    # keys the guard's per-client budgets (brokerd/addons/http_guard.py).
    served = (*inet, "AF_NETLINK")
    if config.web_listen:
        found.append(Need("web.listen", f"the dashboard listens on {config.web_listen} (TCP; NETLINK: "
                          "whose connection it is)", families=served, network=True, off={"web_listen": ""}))
    if config.metrics_listen:
        found.append(Need("metrics.listen", f"Prometheus scrapes {config.metrics_listen} (TCP; NETLINK: "
                          "whose connection it is)", families=served, network=True, off={"metrics_listen": ""}))
    if config.metrics_job_mapping_dir is not None:
        found.append(Need("metrics.hpc_job_mapping_dir",
                          f"lease ids per device for dcgm-exporter in {config.metrics_job_mapping_dir}",
                          writes=(config.metrics_job_mapping_dir,), off={"metrics_job_mapping_dir": None}))
    if config.enforce_mode == "acl":
        found.append(Need("enforce.mode", "the device gate finds who holds a node open in other users' "
                          "/proc/PID/fd (mode 0500, theirs) and /proc/PID/maps (ptrace access)",
                          capabilities=("CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"), off={"enforce_mode": "off"}))
    if config.slurm_mode == "delegate":
        found.append(Need("slurm.mode", "salloc runs as the requesting user (setpriv --reuid --regid "
                          "--init-groups) and reaches slurmctld over TCP",
                          capabilities=("CAP_SETUID", "CAP_SETGID"), families=inet, network=True,
                          syscalls=("@setuid", "capset"), off={"slurm_mode": "off"}))
    if config.socket_group:
        found.append(Need("server.socket_group", f"the sockets are handed to group {config.socket_group}",
                          capabilities=("CAP_CHOWN",), syscalls=("@chown",), off={"socket_group": ""}))
    for key, path in (("server.state_dir", config.state_dir), ("server.socket", config.socket.parent)):
        if _outside_unit(path):
            found.append(Need(key, f"{path} is outside the unit's own folders", writes=(path,)))
    return found


def render_dropin(config: Config) -> str:
    """The drop-in granting what `needs(config)` lists, with the reason beside each line."""
    lines = [f"# Written by `vaccel-brokerd write-unit-dropin` from {config.source or 'the defaults'}:",
             "# what the features turned on there need beyond the shipped unit (docs/service.md).",
             "# Rewritten at install and at every systemctl reload: change brokerd.toml, not this file.",
             "[Service]"]
    found = needs(config)
    for need in found:
        lines += ["", f"# {need.feature}: {need.why}"]
        if need.capabilities:
            lines.append(f"CapabilityBoundingSet={' '.join(need.capabilities)}")
        if need.families:
            lines.append(f"RestrictAddressFamilies={' '.join(need.families)}")
        if need.network:
            lines.append("PrivateNetwork=no")
        if need.syscalls:
            lines.append(f"SystemCallFilter={' '.join(need.syscalls)}")
        for path in need.writes:
            lines.append(f"ReadWritePaths={path}")
    if not found:
        lines += ["", "# Nothing: the configuration turns on no feature that needs more."]
    return "\n".join(lines) + "\n"


def write_dropin(config: Config, path: Path = DROPIN, root: Path = Path("/")) -> bool:
    """Write the drop-in (atomically) and make the folders it opens that are missing (a
    ReadWritePaths= folder must exist before the unit starts), under `root` when staging.
    True when it changed."""
    text = render_dropin(config)
    for need in needs(config):
        for folder in need.writes:
            (root / folder.relative_to("/")).mkdir(parents=True, exist_ok=True, mode=0o755)
    with_old = path.read_text() if path.exists() else None
    if with_old == text:
        return False
    write_readable(path, text)
    return True


def write_readable(path: Path, text: str) -> Path:
    """Write a file everyone may read (0644: the unit, its drop-in, the packaged config)
    atomically, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    tmp.replace(path)
    return path


def blocks(need: Need) -> list[str]:
    """The unit settings that keep this process from doing what `need` needs (empty: none)."""
    found = []
    if os.geteuid() == 0:  # a user's own broker has no capabilities to look for
        effective, bounding = confinement.capabilities()
        missing = [c for c in need.capabilities if c not in effective]
        if missing:
            where = "CapabilityBoundingSet=" if any(c not in bounding for c in missing) else "AmbientCapabilities="
            found.append(f"{where} lacks {' '.join(missing)}")
    families = [f for f in need.families if confinement.family_blocked(f)]
    if families:
        found.append(f"RestrictAddressFamilies= lacks {' '.join(families)}")
    if need.network and not families and confinement.private_network():
        found.append("PrivateNetwork=yes")
    calls = [g for g in need.syscalls if os.geteuid() == 0 and confinement.syscalls_blocked(g)]
    if calls:
        found.append(f"SystemCallFilter= blocks {' '.join(calls)}")
    for path in need.writes:
        if not confinement.writable(path):
            found.append(f"ReadWritePaths= lacks {path}")
    return found


def refuse_blocked(config: Config, *, moment: str = "start", only: set[str] | None = None) -> Config:
    """`config` with every feature the running unit blocks turned off, each refused with
    one journal line naming the settings (`only`: check just these features)."""
    for need in needs(config):
        if only is not None and need.feature not in only:
            continue
        settings = blocks(need)
        if not settings:
            continue
        log_event("unit", f"{need.feature} refused at {moment}: the unit {UNIT} blocks it "
                  f"({'; '.join(settings)}); to grant it: {APPLY}", level=logging.ERROR,
                  feature=need.feature, setting=settings[0].split()[0])
        if need.off:
            config = dataclasses.replace(config, **need.off)
    return config
