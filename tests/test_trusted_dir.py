"""brokerd/base/trusted_dir.py: a folder the daemon writes into as root is opened from /, one
component at a time, and refused when anyone else could write it, replace it or redirect
the way to it (issue 31 item 4); tests/test_hostile_surfaces.py has the attack itself."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from brokerd.base.trusted_dir import UntrustedDir, open_trusted_dir

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")
OTHER = 65534  # nobody


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A folder like /tmp: everyone may write, the sticky bit protects each one's entries."""
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    return folder


def opened(path: Path, **kwargs) -> os.stat_result:
    fd = open_trusted_dir(path, **kwargs)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def test_a_missing_folder_under_a_sticky_one_is_made_ours_and_closed_to_others(shared: Path):
    made = opened(shared / "jobmap", create_mode=0o755)
    assert (made.st_uid, stat.S_IMODE(made.st_mode)) == (os.geteuid(), 0o755)
    assert opened(shared / "jobmap").st_ino == made.st_ino  # the second time it is simply opened
    deeper = opened(shared / "run" / "vaccel" / "jobmap", create_mode=0o755)  # the way is made too
    assert (deeper.st_uid, stat.S_IMODE((shared / "run").stat().st_mode)) == (os.geteuid(), 0o755)
    with pytest.raises(UntrustedDir, match="does not exist"):
        opened(shared / "missing")


@ROOT_ONLY
def test_a_folder_another_user_made_or_may_write_is_refused(shared: Path):
    squat = shared / "squat"
    squat.mkdir()
    os.chown(squat, OTHER, OTHER)
    with pytest.raises(UntrustedDir, match=f"belongs to uid {OTHER}"):
        opened(squat, create_mode=0o755)
    loose = shared / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(UntrustedDir, match="writable by others"):
        opened(loose)


def test_a_folder_in_a_folder_others_may_write_without_the_sticky_bit_is_refused(tmp_path: Path):
    open_to_all = tmp_path / "open"
    (open_to_all / "inner").mkdir(parents=True)
    os.chmod(open_to_all, 0o777)  # anyone could rename "inner" away and put their own in its place
    with pytest.raises(UntrustedDir, match=f"{open_to_all} is writable by others"):
        opened(open_to_all / "inner")


@ROOT_ONLY
def test_links_are_followed_only_when_root_or_we_own_them(shared: Path, tmp_path: Path):
    target = tmp_path / "real"
    target.mkdir()
    ours = shared / "ours"
    ours.symlink_to(target)
    assert opened(ours / ".").st_ino == target.stat().st_ino
    theirs = shared / "theirs"
    theirs.symlink_to(target)
    os.lchown(theirs, OTHER, OTHER)
    with pytest.raises(UntrustedDir, match="symlink owned by uid"):
        opened(theirs, create_mode=0o755)
    # A link of ours that leads through someone else's folder is judged by its target's way.
    elsewhere = shared / "elsewhere"
    elsewhere.mkdir()
    os.chown(elsewhere, OTHER, OTHER)
    (shared / "via").symlink_to(elsewhere)
    with pytest.raises(UntrustedDir, match=f"belongs to uid {OTHER}"):
        opened(shared / "via")


def test_only_plain_absolute_paths(tmp_path: Path):
    with pytest.raises(UntrustedDir, match="absolute"):
        opened(Path("relative/folder"))
    with pytest.raises(UntrustedDir, match=r"'\.\.'"):
        opened(tmp_path / ".." / tmp_path.name)
