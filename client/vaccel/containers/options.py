"""The command-line options of `docker run` and `podman run`, and of each engine's global
options before `run`: which take a value. client/vaccel/containers/engine_command.py needs them to find
the IMAGE exactly (`-v /a:/b img` and `--rm img` differ only in whether the option eats the
next word), so an option missing here is refused rather than guessed.

Taken from `docker run --help` (Docker 20.10.24, Debian 12) and `podman run --help`
(4.3.1), plus the options later releases added (marked "later"). Hidden aliases that the
engines still accept (`--net`, `--net-alias`) are listed too.
"""

from __future__ import annotations

# Docker's `run` options that take a value. Both `--opt value` and `--opt=value`; the
# one-letter ones also `-ovalue` and as the last letter of a cluster (`-itv /a:/b`).
DOCKER_RUN_VALUE = frozenset({
    "--add-host", "--attach", "--blkio-weight", "--blkio-weight-device", "--cap-add", "--cap-drop",
    "--cgroup-parent", "--cgroupns", "--cidfile", "--cpu-period", "--cpu-quota", "--cpu-rt-period",
    "--cpu-rt-runtime", "--cpu-shares", "--cpus", "--cpuset-cpus", "--cpuset-mems", "--detach-keys",
    "--device", "--device-cgroup-rule", "--device-read-bps", "--device-read-iops", "--device-write-bps",
    "--device-write-iops", "--dns", "--dns-option", "--dns-search", "--domainname", "--entrypoint", "--env",
    "--env-file", "--expose", "--gpus", "--group-add", "--health-cmd", "--health-interval", "--health-retries",
    "--health-start-period", "--health-timeout", "--hostname", "--ip", "--ip6", "--ipc", "--isolation",
    "--kernel-memory", "--label", "--label-file", "--link", "--link-local-ip", "--log-driver", "--log-opt",
    "--mac-address", "--memory", "--memory-reservation", "--memory-swap", "--memory-swappiness", "--mount",
    "--name", "--network", "--network-alias", "--oom-score-adj", "--pid", "--pids-limit", "--platform",
    "--publish", "--pull", "--restart", "--runtime", "--security-opt", "--shm-size", "--stop-signal",
    "--stop-timeout", "--storage-opt", "--sysctl", "--tmpfs", "--ulimit", "--user", "--userns", "--uts",
    "--volume", "--volume-driver", "--volumes-from", "--workdir",
    "--net", "--net-alias",  # hidden aliases of --network, --network-alias
    "--annotation", "--health-start-interval",  # later
})
DOCKER_RUN_FLAGS = frozenset({
    "--detach", "--disable-content-trust", "--help", "--init", "--interactive", "--no-healthcheck",
    "--oom-kill-disable", "--privileged", "--publish-all", "--read-only", "--rm", "--sig-proxy", "--tty",
    "--quiet", "--use-api-socket",  # later
})
DOCKER_RUN_SHORT = {
    "a": "--attach", "c": "--cpu-shares", "d": "--detach", "e": "--env", "h": "--hostname", "i": "--interactive",
    "l": "--label", "m": "--memory", "p": "--publish", "P": "--publish-all", "q": "--quiet", "t": "--tty",
    "u": "--user", "v": "--volume", "w": "--workdir",
}

PODMAN_RUN_VALUE = frozenset({
    "--add-host", "--annotation", "--arch", "--attach", "--authfile", "--blkio-weight", "--blkio-weight-device",
    "--cap-add", "--cap-drop", "--cgroup-conf", "--cgroup-parent", "--cgroupns", "--cgroups", "--chrootdirs",
    "--cidfile", "--conmon-pidfile", "--cpu-period", "--cpu-quota", "--cpu-rt-period", "--cpu-rt-runtime",
    "--cpu-shares", "--cpus", "--cpuset-cpus", "--cpuset-mems", "--detach-keys", "--device",
    "--device-cgroup-rule", "--device-read-bps", "--device-read-iops", "--device-write-bps", "--device-write-iops",
    "--dns", "--dns-option", "--dns-search", "--entrypoint", "--env", "--env-file", "--env-merge", "--expose",
    "--gidmap", "--group-add", "--health-cmd", "--health-interval", "--health-on-failure", "--health-retries",
    "--health-start-period", "--health-timeout", "--hostname", "--hostuser", "--image-volume", "--init-path",
    "--ip", "--ip6", "--ipc", "--label", "--label-file", "--log-driver", "--log-opt", "--mac-address", "--memory",
    "--memory-reservation", "--memory-swap", "--memory-swappiness", "--mount", "--name", "--network",
    "--network-alias", "--oom-score-adj", "--os", "--passwd-entry", "--personality", "--pid", "--pidfile",
    "--pids-limit", "--platform", "--pod", "--pod-id-file", "--preserve-fds", "--publish", "--pull", "--requires",
    "--restart", "--sdnotify", "--seccomp-policy", "--secret", "--security-opt", "--shm-size", "--stop-signal",
    "--stop-timeout", "--subgidname", "--subuidname", "--sysctl", "--systemd", "--timeout", "--tmpfs", "--tz",
    "--uidmap", "--ulimit", "--umask", "--unsetenv", "--user", "--userns", "--uts", "--variant", "--volume",
    "--volumes-from", "--workdir",
    "--net",  # hidden alias of --network
    "--gpus", "--group-entry", "--health-log-destination", "--health-max-log-count", "--health-max-log-size",
    "--health-startup-cmd", "--health-startup-interval", "--health-startup-retries", "--health-startup-success",
    "--health-startup-timeout", "--retry", "--retry-delay", "--decryption-key", "--cert-dir", "--creds",
    "--rdt-class", "--shm-size-systemd",  # later
})
PODMAN_RUN_FLAGS = frozenset({
    "--detach", "--disable-content-trust", "--env-host", "--help", "--http-proxy", "--init", "--interactive",
    "--no-healthcheck", "--no-hosts", "--oom-kill-disable", "--passwd", "--privileged", "--publish-all", "--quiet",
    "--read-only", "--read-only-tmpfs", "--replace", "--rm", "--rmi", "--rootfs", "--sig-proxy", "--tls-verify",
    "--tty", "--unsetenv-all",
})
PODMAN_RUN_SHORT = {
    "a": "--attach", "c": "--cpu-shares", "d": "--detach", "e": "--env", "h": "--hostname", "i": "--interactive",
    "l": "--label", "m": "--memory", "p": "--publish", "P": "--publish-all", "q": "--quiet", "t": "--tty",
    "u": "--user", "v": "--volume", "w": "--workdir",
}

# The engines' global options (before `run`).
DOCKER_GLOBAL_VALUE = frozenset({"--config", "--context", "--host", "--log-level", "--tlscacert", "--tlscert",
                                 "--tlskey"})
DOCKER_GLOBAL_FLAGS = frozenset({"--debug", "--tls", "--tlsverify"})
DOCKER_GLOBAL_SHORT = {"c": "--context", "D": "--debug", "H": "--host", "l": "--log-level"}

PODMAN_GLOBAL_VALUE = frozenset({
    "--cgroup-manager", "--conmon", "--connection", "--events-backend", "--hooks-dir", "--identity", "--log-level",
    "--namespace", "--network-cmd-path", "--network-config-dir", "--root", "--runroot", "--runtime", "--runtime-flag",
    "--ssh", "--storage-driver", "--storage-opt", "--tmpdir", "--url", "--volumepath",
    "--cdi-spec-dir", "--db-backend", "--imagestore", "--module", "--out",  # later
})
PODMAN_GLOBAL_FLAGS = frozenset({"--noout", "--remote", "--syslog", "--transient-store"})
PODMAN_GLOBAL_SHORT = {"c": "--connection", "r": "--remote"}
