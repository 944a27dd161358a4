"""Folders the daemon writes into as root, opened so that nobody else can redirect a write.

A path is only as safe as every folder on the way to it: whoever may replace one of them
(rename it away and put their own in its place), or plant a link in it, decides where a
write by name lands, and a root daemon then overwrites or chmods any file on the host
(issue 31: a user who made `[metrics] hpc_job_mapping_dir` first, under /tmp, had root
write through their links). So a trusted folder is opened one component at a time from /,
each with openat(O_NOFOLLOW) in the folder before it, and refused unless:

- every folder on the way belongs to root or to the daemon's user, and others cannot
  write it, or it is sticky (/tmp: others may write there, but cannot rename or remove
  what belongs to someone else, and each component belongs to root or to us);
- the folder itself belongs to the daemon's user and nobody else may write it;
- a symlink on the way belongs to root or to us (then it is followed as its text says,
  every folder of its target checked in turn); anyone else's link is refused.

The caller keeps the returned descriptor and names files relative to it (dir_fd=), so a
check and the write that follows it are about the same folder.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
MAX_LINKS = 40  # the kernel's own bound on links in one path walk


class UntrustedDir(Exception):
    """The folder, or one on the way to it, is controlled by someone else; says which and why."""


def open_trusted_dir(path: Path, *, create_mode: int | None = None) -> int:
    """An O_DIRECTORY descriptor of `path` (absolute) after the checks above. With
    `create_mode`, a folder that is missing on the way, the last one included, is made
    (mkdirat in its checked parent, then that mode)."""
    if not path.is_absolute():
        raise UntrustedDir(f"{path}: not an absolute path")
    me = os.geteuid()
    pending = list(reversed(path.parts[1:]))  # the components still to walk, the next one last
    fd, where, links = os.open("/", _DIR), Path("/"), 0
    try:
        _judge(os.fstat(fd), where, me, last=not pending)
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                raise UntrustedDir(f"{path}: '..' is not allowed in a trusted path")
            st = _entry(fd, name, where, me, create_mode)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if st.st_uid not in (0, me) or links > MAX_LINKS:
                    raise UntrustedDir(f"{where / name} is a symlink owned by uid {st.st_uid}: "
                                       "a link someone else owns is never followed")
                target = Path(os.readlink(name, dir_fd=fd))
                if target.is_absolute():
                    os.close(fd)
                    fd, where = os.open("/", _DIR), Path("/")
                pending.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
                continue
            child = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd, where = child, where / name
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                raise UntrustedDir(f"{where} was replaced while it was being opened")
            _judge(opened, where, me, last=not pending)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _entry(fd: int, name: str, where: Path, me: int, create_mode: int | None) -> os.stat_result:
    """lstat of `name` in the folder `fd`; made first (as a folder) when missing and asked to."""
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        if create_mode is None:
            raise UntrustedDir(f"{where / name} does not exist") from None
    try:
        os.mkdir(name, create_mode, dir_fd=fd)
    except FileExistsError:
        pass  # someone made it between the look and the mkdir: judged below like any other
    else:
        child = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=fd)
        try:
            os.fchmod(child, create_mode)  # mkdir's mode is masked by the umask
        finally:
            os.close(child)
    return os.stat(name, dir_fd=fd, follow_symlinks=False)


def _judge(st: os.stat_result, where: Path, me: int, *, last: bool) -> None:
    owners = (me,) if last else (0, me)
    if st.st_uid not in owners:
        whose = "the broker's" if last else "root's or the broker's"
        raise UntrustedDir(f"{where} belongs to uid {st.st_uid}; it must be {whose} (uid {me})")
    others_write = st.st_mode & 0o022
    if others_write and (last or not st.st_mode & stat.S_ISVTX):
        raise UntrustedDir(f"{where} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}), so they could "
                           "replace what is in it")
