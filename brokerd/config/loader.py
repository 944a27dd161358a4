"""Daemon configuration: a TOML file (default /etc/vaccel/brokerd.toml), command-line
overrides on top. Loading validates everything, so SIGHUP can reject a bad file and
keep the old configuration.
"""

from __future__ import annotations

import difflib
import grp
import importlib.util
import os
import shutil
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from brokerd.config.policy import PolicyConfig, PolicyError, line_of, parse_policy
from vaccel_common.paths import default_socket
from vaccel_common.units import parse_duration, parse_size_mib

DEFAULT_CONFIG_PATH = Path("/etc/vaccel/brokerd.toml")


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Config:
    socket: Path = field(default_factory=lambda: Path(default_socket()))
    # Every local user must be able to connect; who may do what is decided per call
    # from kernel-verified credentials, not by file permissions.
    socket_mode: int = 0o666
    socket_group: str = ""  # with socket_mode 0660: only this group may use the broker
    state_dir: Path = field(
        default_factory=lambda: Path("/var/lib/vaccel") if os.getuid() == 0
        else Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "vaccel"
    )
    inventory: Path | None = None
    admin_group: str = "vaccel-admin"
    heartbeat_ttl_s: float = 30.0
    max_lease_duration_s: float = 7 * 86400.0  # 0 = unlimited
    probe_interval_s: float = 10.0
    unleased_processes: str = "report"  # report | signal
    unleased_grace_s: float = 300.0
    # On a host where no GPU probe finds a device: lease the CPU as one device (one job at a
    # time on the whole machine: a laptop, a CI runner). Off on a real server by default.
    offer_cpu: bool = False
    allocator_config: str = "expandable_segments:True"
    memory_cap_mib: int = 0  # per-process cap applied to every lease, 0 = none
    token_ttl_s: float = 600.0
    log_level: str = "info"
    durability: str = "crash"  # crash | power: how far a commit goes before replying (brokerd/state/store.py)
    enforce_mode: str = "off"  # off | acl: device nodes open only for the lease holder (brokerd/addons/enforce/)
    enforce_grace_s: float = 10.0  # SIGTERM -> SIGKILL for what still holds a node after its lease
    web_listen: str = ""  # host:port of the read-only dashboard (brokerd/addons/web), "" = none
    accounting_keep_s: float = 400 * 86400.0  # usage rows older than this are pruned
    accounting_max_rows: int = 1_000_000  # and beyond this many, the oldest first (~200 MB)
    accounting_per_user_report: str = "admins"  # admins | everyone: who sees other users' rows
    metrics_listen: str = ""  # host:port of the Prometheus endpoint (brokerd/addons/metrics.py), "" = none
    metrics_job_mapping_dir: Path | None = None  # lease ids per device for dcgm-exporter, None = off
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # [policy]: brokerd/config/policy.py
    # [slurm] (docs/slurm.md), read at start-up only: "delegate" makes Slurm the allocator
    slurm_mode: str = "off"  # off | delegate | submit
    slurm_node: str = ""  # this host's Slurm NodeName, "" = the short hostname
    slurm_partition: str = ""  # "" = Slurm's default partition
    slurm_gres: str = "gpu"  # the GRES name the GPUs have in gres.conf
    # [containers] (docs/containers.md): the engine API sockets the broker may ask ("" = none),
    # and how long a leased container gets between SIGTERM and SIGKILL when its lease ends
    containers_docker: str = ""
    containers_podman: str = ""
    containers_stop_grace_s: float = 10.0
    # [sharing] (docs/sharing.md): devices leased by memory ("gpu3", a uuid, or "all"), and how
    # long a share may use more than its memory before its lease ends and its processes stop
    sharing_devices: tuple[str, ...] = ()
    sharing_over_budget_grace_s: float = 30.0
    source: str = "<defaults>"

    def admin_gid(self) -> int | None:
        try:
            return grp.getgrnam(self.admin_group).gr_gid
        except KeyError:
            return None


def _octal_mode(value: object) -> int:
    # TOML's 0o660 is an integer and 0660 is invalid: a string keeps one obvious spelling.
    if not isinstance(value, str):
        raise ValueError('write the mode as a string, e.g. socket_mode = "0660"')
    return int(value, 8)


def _whole_number(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected a whole number, got {value!r}")
    return value


def _true_or_false(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def listen_address(value: object) -> str:
    """A TCP address to serve on, "host:port" ("[::1]:8642" for IPv6), a bare port for the
    loopback address, or "" for none. Checked here so a typo stops the start or the
    reload, not the server later."""
    if not isinstance(value, str):
        raise ValueError('write the address as a string, e.g. "127.0.0.1:8642"')
    if not value:
        return ""
    if value.isdigit():
        value = f"127.0.0.1:{value}"  # only this host's users: what `vaccel status` shows them
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f'{value!r} is not host:port with a port from 1 to 65535, e.g. "127.0.0.1:8642"')
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f'{value!r}: write an IPv6 host in brackets, e.g. "[::1]:8642"')
    return value


def engine_socket(value: object) -> str:
    """A container engine's API socket: an absolute path or unix:///path, "" for none."""
    if not isinstance(value, str):
        raise ValueError('write the socket as a string, e.g. "/run/docker.sock"')
    path = value.removeprefix("unix://")
    if value and not path.startswith("/"):
        raise ValueError(f"{value!r}: the broker asks an engine over its local Unix socket: an absolute path "
                         'or unix:///path, e.g. "/run/docker.sock"')
    return path


def device_names(value: object) -> tuple[str, ...]:
    """A list of device names as `vaccel status` shows them (gpu3, gpu0.1), uuids, or "all"."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError('write a list of device names, e.g. ["gpu3"], ["GPU-6f1a..."] or ["all"]')
    return tuple(value)


# TOML table.key -> (Config field, parser)
_KEYS: dict[str, tuple[str, Any]] = {
    "server.socket": ("socket", Path),
    "server.socket_mode": ("socket_mode", _octal_mode),
    "server.socket_group": ("socket_group", str),
    "server.state_dir": ("state_dir", Path),
    "server.inventory": ("inventory", Path),
    "server.admin_group": ("admin_group", str),
    "server.log_level": ("log_level", str),
    "server.durability": ("durability", str),
    "leases.heartbeat_ttl": ("heartbeat_ttl_s", parse_duration),
    "leases.max_duration": ("max_lease_duration_s", parse_duration),
    "leases.token_ttl": ("token_ttl_s", parse_duration),
    "probe.refresh_interval": ("probe_interval_s", parse_duration),
    "probe.unleased_processes": ("unleased_processes", str),
    "probe.unleased_grace": ("unleased_grace_s", parse_duration),
    "probe.offer_cpu": ("offer_cpu", _true_or_false),
    "memory.allocator_config": ("allocator_config", str),
    "memory.memory_cap": ("memory_cap_mib", parse_size_mib),
    "enforce.mode": ("enforce_mode", str),
    "enforce.grace": ("enforce_grace_s", parse_duration),
    "web.listen": ("web_listen", listen_address),
    "accounting.keep": ("accounting_keep_s", parse_duration),
    "accounting.max_rows": ("accounting_max_rows", _whole_number),
    "accounting.per_user_report": ("accounting_per_user_report", str),
    "metrics.listen": ("metrics_listen", listen_address),
    "metrics.hpc_job_mapping_dir": ("metrics_job_mapping_dir", lambda v: Path(v) if v else None),
    "slurm.mode": ("slurm_mode", str),
    "slurm.node": ("slurm_node", str),
    "slurm.partition": ("slurm_partition", str),
    "slurm.gres": ("slurm_gres", str),
    "containers.docker": ("containers_docker", engine_socket),
    "containers.podman": ("containers_podman", engine_socket),
    "containers.stop_grace": ("containers_stop_grace_s", parse_duration),
    "sharing.devices": ("sharing_devices", device_names),
    "sharing.over_budget_grace": ("sharing_over_budget_grace_s", parse_duration),
}


def _flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _validate(config: Config, lines: dict[str, str] | None = None) -> Config:
    """Refuse what no daemon can run with; each message starts with the file and the line
    of the key to fix (`lines`: TOML key -> "path:line", as load_config found them)."""
    def at(key: str) -> str:
        return (lines or {}).get(key, config.source)
    if config.heartbeat_ttl_s < 1:
        raise ConfigError(f"{at('leases.heartbeat_ttl')}: leases.heartbeat_ttl must be at least 1s")
    if config.accounting_keep_s < 86400:
        raise ConfigError(f"{at('accounting.keep')}: accounting.keep must be at least 1d")
    if config.accounting_max_rows < 1000:
        raise ConfigError(f"{at('accounting.max_rows')}: accounting.max_rows must be at least 1000")
    if config.accounting_per_user_report not in ("admins", "everyone"):
        raise ConfigError(f"{at('accounting.per_user_report')}: accounting.per_user_report must be 'admins' "
                          "or 'everyone'")
    if config.metrics_job_mapping_dir is not None and not config.metrics_job_mapping_dir.is_absolute():
        raise ConfigError(f"{at('metrics.hpc_job_mapping_dir')}: metrics.hpc_job_mapping_dir must be an absolute path")
    if config.token_ttl_s < 60:
        raise ConfigError(f"{at('leases.token_ttl')}: leases.token_ttl must be at least 60s")
    if config.probe_interval_s < 0.5:
        raise ConfigError(f"{at('probe.refresh_interval')}: probe.refresh_interval must be at least 0.5s")
    if config.unleased_processes not in ("report", "signal"):
        raise ConfigError(f"{at('probe.unleased_processes')}: probe.unleased_processes must be 'report' or 'signal'")
    if not 0 <= config.socket_mode <= 0o777:
        raise ConfigError(f"{at('server.socket_mode')}: server.socket_mode must be an octal mode like \"0666\"")
    if config.socket_group:
        try:
            grp.getgrnam(config.socket_group)
        except KeyError:
            raise ConfigError(f"{at('server.socket_group')}: server.socket_group {config.socket_group!r} "
                              "does not exist") from None
    if config.durability not in ("crash", "power"):
        raise ConfigError(f"{at('server.durability')}: server.durability must be 'crash' (survives the "
                          "daemon's crash, the default) or 'power' (every commit fsync'd: survives a power loss)")
    if config.log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"{at('server.log_level')}: server.log_level must be debug, info, warning or error")
    if config.enforce_mode not in ("off", "acl"):
        raise ConfigError(f"{at('enforce.mode')}: enforce.mode must be 'off' or 'acl'")
    if config.enforce_mode == "acl" and importlib.util.find_spec("posix1e") is None:
        raise ConfigError(f"{at('enforce.mode')}: enforce.mode = \"acl\" needs the pylibacl package: "
                          "pip install 'vaccel[enforce]' (it builds against libacl1-dev)")
    if config.slurm_mode not in ("off", "delegate", "submit"):
        raise ConfigError(f"{at('slurm.mode')}: slurm.mode must be 'off', 'delegate' or 'submit', "
                          f"not {config.slurm_mode!r}")
    missing = [p for p in ("salloc", "scancel", "scontrol")
               if config.slurm_mode == "delegate" and shutil.which(p) is None]
    if missing:
        raise ConfigError(f"{at('slurm.mode')}: slurm.mode = \"delegate\" needs Slurm's client programs on PATH; "
                          f"missing: {', '.join(missing)}")
    if not 0 <= config.containers_stop_grace_s <= 3600:
        raise ConfigError(f"{at('containers.stop_grace')}: containers.stop_grace must be from 0s to 1h")
    if not config.slurm_gres or any(c in config.slurm_gres for c in ":,= "):
        raise ConfigError(f"{at('slurm.gres')}: slurm.gres must be a GRES name as gres.conf gives it, e.g. \"gpu\"")
    return config


def load_config(path: Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read `path` (missing default file = defaults), then apply non-None overrides."""
    config = Config()
    lines: dict[str, str] = {}  # TOML key -> "path:line", for the errors of _validate
    if path is not None and (path != DEFAULT_CONFIG_PATH or path.exists()):
        try:
            text = path.read_text()
            doc = tomllib.loads(text)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        values: dict[str, Any] = {"source": str(path)}
        if "policy" in doc:  # nested tables per group: read by its own parser
            try:
                values["policy"] = parse_policy(doc.pop("policy"), str(path), text)
            except PolicyError as exc:
                raise ConfigError(str(exc)) from exc
        for key, raw in _flatten(doc).items():
            table, _, leaf = key.rpartition(".")
            line = line_of(text, table, leaf)
            where = f"{path}:{line}" if line else str(path)  # the line to fix, as policy and contract errors say
            lines[key] = where
            if key not in _KEYS:
                close = difflib.get_close_matches(key, list(_KEYS), n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(_KEYS))}"
                raise ConfigError(f"{where}: unknown key {key!r}; {hint}")
            name, parse = _KEYS[key]
            try:
                values[name] = parse(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{where}: {key}: {exc}") from exc
        config = replace(config, **values)
    known_fields = {f.name for f in fields(Config)}
    extra = {k: v for k, v in (overrides or {}).items() if v is not None and k in known_fields}
    return _validate(replace(config, **extra), lines)
