"""Where the broker's socket is: one rule shared by the daemon and every client.

root: /run/vaccel/brokerd.sock; others: $XDG_RUNTIME_DIR/vaccel/brokerd.sock, else
/tmp/vaccel-$UID/brokerd.sock. Clients honour VACCEL_SOCKET first. The identity socket
the token is minted on sits beside it with the suffix `.id`.

Paths are plain strings: every `vaccel run` imports this module, and pathlib costs it
~9 ms (pathlib brings urllib.parse and ipaddress), a tenth of the whole command.
"""

from __future__ import annotations

import os
import stat

SYSTEM_SOCKET = "/run/vaccel/brokerd.sock"
# The broker host's config, which clients read too: a login node's [slurm] mode = "submit"
# sends `vaccel run` to Slurm (vaccel/slurm/submit.py, vaccel/run/quick_run.py).
BROKER_CONFIG_ENV = "VACCEL_BROKER_CONFIG"
BROKER_CONFIG = "/etc/vaccel/brokerd.toml"


def default_socket(uid: int | None = None) -> str:
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return os.fspath(SYSTEM_SOCKET)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "vaccel", "brokerd.sock")
    return f"/tmp/vaccel-{uid}/brokerd.sock"


def client_socket(explicit: str | os.PathLike[str] | None = None) -> str:
    """The socket a client talks to: the argument, else VACCEL_SOCKET, else the default.

    A non-root user with no broker of their own uses the system broker: that is the
    common case on a shared server. So does one whose personal socket folder belongs to
    someone else."""
    if explicit:
        return os.fspath(explicit)
    env = os.environ.get("VACCEL_SOCKET")
    if env:
        return env
    own, system = default_socket(), os.fspath(SYSTEM_SOCKET)
    if own != system and os.path.exists(system) and not (
            os.path.exists(own) and _is_ours(os.path.dirname(own))):
        return system
    return own


def _is_ours(folder: str) -> bool:
    """Whether a personal socket folder is this user's: /tmp/vaccel-$UID is a fixed name in
    a shared folder, so another user may have created it first (with an impostor broker in
    it). Such a folder is not ours, and the client uses the system broker instead."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return not stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid()


def identity_socket(grpc_socket: str | os.PathLike[str]) -> str:
    return os.fspath(grpc_socket) + ".id"
