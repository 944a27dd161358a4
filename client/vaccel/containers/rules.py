"""What `vaccel run -- docker run ...` refuses, before anything starts: the options that
would give the container devices the lease does not hold, or let it pass for another lease.
Each rule is one function, in RULES, that returns why (one line) or "". docs/containers.md
gives the reasons at length.

These are coordination, not a security boundary: a member of the docker group can run the
engine without vaccel and is root-equivalent anyway. They catch the option copied from a
tutorial (`--gpus all`, `--privileged`) that would silently take other people's GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from vaccel.containers.engine_command import ContainerRefused, ContainerRun, Option
from vaccel_common.backends import GPU_CDI_KINDS, VISIBLE_DEVICE_VARS, is_gpu_node

LABEL_PREFIX = "org.vaccel."
# Capabilities with which container root gets past the devices cgroup and the device
# nodes it was given: SYS_ADMIN mounts (a writable cgroupfs: devices.allow), SYS_MODULE
# loads kernel code, ALL is both.
_ROOT_CAPABILITIES = frozenset({"SYS_ADMIN", "SYS_MODULE", "ALL"})


def _gpus(run: ContainerRun) -> str:
    option = run.first("--gpus")
    return f"{option.spelling}: vaccel gives the container the leased GPUs itself; drop it" if option else ""


def _privileged(run: ContainerRun) -> str:
    if run.flag("--privileged"):
        return "--privileged gives the container every device of the host, other users' GPUs among them"
    return ""


def _devices(run: ContainerRun) -> str:
    """A GPU node by path (or a symlink to one, or /dev/dri), or a GPU by its CDI name."""
    for option in (o for o in run.options if o.name == "--device" and o.value is not None):
        source = option.value.split(":")[0]
        kind = source.partition("=")[0] if not source.startswith("/") and "=" in source else ""
        if kind in GPU_CDI_KINDS or kind.endswith("/gpu"):
            return f"{option.spelling}: a GPU named by CDI; vaccel gives the container the leased GPUs itself"
        if source.startswith("/") and is_gpu_node(source):
            return (f"{option.spelling}: {source} is a GPU device node; vaccel gives the container the leased "
                    "GPUs' nodes itself")
    return ""


def _cgroup_rules(run: ContainerRun) -> str:
    option = run.first("--device-cgroup-rule")
    if option:
        return f"{option.spelling}: it opens device majors, other GPUs' nodes among them, to the container"
    return ""


def _capabilities(run: ContainerRun) -> str:
    for option in (o for o in run.options if o.name == "--cap-add" and o.value is not None):
        for cap in option.value.split(","):
            if cap.strip().upper().removeprefix("CAP_") in _ROOT_CAPABILITIES:
                return (f"{option.spelling}: with {cap.strip().upper()} container root can reach devices it "
                        "was not given")
    return ""


def _host_namespaces(run: ContainerRun) -> str:
    """--pid=host: the container's root could signal and read every host process, other users'
    jobs among them. --userns=host: on an engine that maps container root to an unprivileged
    uid, it makes container root the host's root again."""
    for name in ("--pid", "--userns"):
        option = next((o for o in run.options if o.name == name and o.value == "host"), None)
        if option:
            return f"{option.spelling}: a leased container keeps its own {name[2:]} namespace"
    return ""


def _mounts(run: ContainerRun) -> str:
    """A bind mount of /dev, a folder above it, or a GPU node, as the engine will mount it: the
    path resolved (a symlink to /dev is /dev; binds are recursive, so / holds /dev too), and a
    local volume that binds a path (`o=bind`) counted as a bind of that path. On rootless
    podman nothing but the node's ACL stands between such a mount and the GPU (no devices
    cgroup on cgroup v1)."""
    for option, source in _bind_sources(run):
        real = os.path.realpath(source)
        if real == "/dev" or "/dev".startswith(real.rstrip("/") + "/") or is_gpu_node(source):
            shown = source if real == os.path.normpath(source) else f"{source} ({real})"
            return f"{option.spelling}: mounts {shown}; vaccel gives the container the leased GPUs' nodes itself"
    return ""


def _environment(run: ContainerRun) -> str:
    for spelling, name in _env_names(run):
        if name in VISIBLE_DEVICE_VARS or name.startswith("VACCEL_"):
            return f"{spelling}: vaccel sets {name} in the container from the lease"
    return ""


def _labels(run: ContainerRun) -> str:
    for spelling, key in _label_keys(run):
        if key.startswith(LABEL_PREFIX):
            return f"{spelling}: labels {LABEL_PREFIX}* name the container's lease and are vaccel's to set"
    return ""


RULES: tuple[Callable[[ContainerRun], str], ...] = (
    _gpus, _privileged, _devices, _cgroup_rules, _capabilities, _host_namespaces, _mounts, _environment, _labels)


def check(run: ContainerRun) -> None:
    """Raise ContainerRefused with the first rule's reason, naming the engine."""
    for rule in RULES:
        reason = rule(run)
        if reason:
            raise ContainerRefused(f"{run.engine} run {reason}")


def _bind_sources(run: ContainerRun) -> Iterator[tuple[Option, str]]:
    """Every host path the run will bind: -v and --mount binds, and the paths local volumes bind
    (named volumes as the engine has them, `--mount volume-opt=` given inline)."""
    for option in run.options:
        if option.value is None:
            continue
        if option.name == "--volume":
            source = option.value.split(":")[0]
            if source.startswith("/"):
                yield option, source
            elif source:  # a named volume: what it binds, if it is a local one with o=bind
                yield from ((option, path) for path in _volume_binds(run, source, {}))
        elif option.name == "--mount":
            pairs = _mount_fields(option.value)
            fields = dict(pairs)  # the last of each key, as the engine keeps it
            source = fields.get("source") or fields.get("src") or ""
            kind = fields.get("type", "volume")
            if kind == "bind" and source:
                yield option, source
            elif kind == "volume":
                inline = dict(v.partition("=")[::2] for k, v in pairs if k == "volume-opt")
                yield from ((option, path) for path in _volume_binds(run, source, inline))


def _mount_fields(value: str) -> list[tuple[str, str]]:
    """(key, value) of each field: the engines read --mount as one CSV line, so a field may be
    quoted (`"source=/dev"`, `"volume-opt=o=bind"`)."""
    import csv  # only for --mount: the quick path imports no csv (nor its re)

    try:
        fields = next(csv.reader([value]), [])
    except csv.Error:
        raise ContainerRefused(f"--mount {value}: not one line of comma-separated fields") from None
    return [(key.strip().lower(), val) for key, _, val in (f.partition("=") for f in fields)]


def _volume_binds(run: ContainerRun, name: str, options: dict[str, str]) -> list[str]:
    """The host path a local volume binds (`type=none,o=bind,device=PATH`), [] for any other.
    Options given inline are the volume's; else the engine's own volume of that name is read."""
    if not options and name:  # imported here: a run without a named volume (most) need not pay for them
        import json
        import subprocess

        done = subprocess.run([run.program, *run.global_words, "volume", "inspect", "--format", "{{json .Options}}",
                               name], capture_output=True, text=True, timeout=30, check=False)
        try:
            options = json.loads(done.stdout) or {} if done.returncode == 0 else {}
        except ValueError:
            options = {}
    binds = "bind" in str(options.get("o", "")).replace(",", " ").split() or "rbind" in str(options.get("o", ""))
    return [str(options["device"])] if binds and str(options.get("device", "")).startswith("/") else []


def _env_names(run: ContainerRun) -> Iterator[tuple[str, str]]:
    """(how it was given, variable name) of every variable the run sets, env files read."""
    for option in run.options:
        if option.value is None:
            continue
        if option.name in ("--env", "--env-merge"):
            yield option.spelling, option.value.partition("=")[0]
        elif option.name == "--env-file":
            for line in _lines(option.value):
                yield f"{option.spelling} ({line.partition('=')[0]})", line.partition("=")[0].strip()


def _label_keys(run: ContainerRun) -> Iterator[tuple[str, str]]:
    for option in run.options:
        if option.value is None:
            continue
        if option.name == "--label":
            yield option.spelling, option.value.partition("=")[0]
        elif option.name == "--label-file":
            for line in _lines(option.value):
                yield f"{option.spelling} ({line.partition('=')[0]})", line.partition("=")[0].strip()


def _lines(path: str) -> list[str]:
    """The settings of an env or label file (comments and blank lines dropped). A file that
    cannot be read is refused: what it would set cannot be checked."""
    try:
        with open(path) as f:
            return [s for s in (line.strip() for line in f) if s and not s.startswith("#")]
    except (OSError, UnicodeDecodeError) as exc:
        raise ContainerRefused(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
