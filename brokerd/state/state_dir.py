"""The state directory is trusted only when nobody but the daemon's user controls it.

Whoever can write into it could plant the token key (and mint a uid-0 token), swap the
database, or point the lock or the key's temporary file at another file through a
symlink. So the daemon refuses to start unless the folder is owned by its own user and
writable by no one else, the folders on the way to it can be replaced by no one else
(brokerd/base/trusted_dir.py), and every entry in it is a plain file of that user, not a
symlink; the files themselves are then opened with O_NOFOLLOW (and new ones O_EXCL).
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from brokerd.base.trusted_dir import UntrustedDir, open_trusted_dir

LOCK_FILE = "brokerd.lock"
SECRET_FILES = ("token.key",)  # readable by the broker alone
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeStateDir(Exception):
    """The state directory, or something in it, is controlled by someone else."""


class StateDirInUse(Exception):
    """Another daemon holds the state directory's lock."""


def check_state_dir(path: Path) -> None:
    """Create the folder (0700) if missing; refuse one another user owns or may write."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    me = os.geteuid()
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, me):
        raise UnsafeStateDir(f"refusing the state directory {path}: it is a symlink owned by uid "
                             f"{link.st_uid}; use a folder owned by uid {me}")
    st = os.stat(path)
    if st.st_uid != me:
        raise UnsafeStateDir(f"refusing the state directory {path}: it belongs to uid {st.st_uid}, not to "
                             f"the broker's uid {me} (chown {me} {path}, or pass another --state-dir)")
    if st.st_mode & 0o022:
        raise UnsafeStateDir(f"refusing the state directory {path}: it is writable by others (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); chmod 700 {path}")
    try:  # and the folders on the way: whoever may replace one of them may replace this one
        os.close(open_trusted_dir(path))
    except UntrustedDir as exc:
        raise UnsafeStateDir(f"refusing the state directory {path}: {exc}") from None
    for entry in os.scandir(path):
        info = entry.stat(follow_symlinks=False)
        loose = 0o077 if entry.name in SECRET_FILES else 0o022
        if stat.S_ISLNK(info.st_mode) or info.st_uid != me or info.st_mode & loose:
            what = ("a symlink" if stat.S_ISLNK(info.st_mode) else
                    f"owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):04o}")
            raise UnsafeStateDir(f"refusing the state directory {path}: {entry.name} is {what}; "
                                 "remove it (nothing in there but the broker's own files is trusted)")


def lock_state_dir(path: Path) -> int:
    """Check the folder, then take its lock (an open fd the caller keeps)."""
    check_state_dir(path)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateDirInUse(path) from None
    return fd


def read_private(path: Path) -> bytes | None:
    """The file's bytes, None when it does not exist. Refuses a symlink (O_NOFOLLOW) and a
    file another user owns or others may read."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UnsafeStateDir(f"refusing {path}: {exc.strerror} (a symlink is not followed)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UnsafeStateDir(f"refusing {path}: owned by uid {st.st_uid} with mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}; it must be the broker's, mode 0600")
        return f.read()


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically through a fresh temporary file (O_EXCL, never
    through a link someone planted), durably."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # unlink removes a planted link itself, not its target
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
