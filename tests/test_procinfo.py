"""brokerd.base.procinfo against a fake /proc tree, and against this process's real one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from brokerd.base.procinfo import ancestors, process_info, short_command, start_time, user_name


def fake_proc(root: Path, pid: int, ppid: int, *, comm: str = "python3", uid: int = 1000,
              argv: list[str] | None = None, starttime: int = 4242) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    # Fields 3.. of stat: state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime cutime cstime priority nice threads itrealvalue starttime ...
    rest = ["S", str(ppid)] + ["0"] * 17 + [str(starttime), "0", "0"]
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")
    (d / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in (argv or [])) + b"\0")


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    fake_proc(tmp_path, 1, 0, comm="systemd", uid=0, argv=["/sbin/init"])
    fake_proc(tmp_path, 500, 1, comm="bash", argv=["-bash"])
    fake_proc(tmp_path, 12345, 500, comm="python3",
              argv=["/usr/bin/python3", "train.py", "--lr", "3e-4"], starttime=987654)
    fake_proc(tmp_path, 777, 12345, comm="weird ) name (x", argv=[])
    return tmp_path


def test_process_info(proc: Path) -> None:
    info = process_info(12345, proc)
    assert info is not None
    assert (info.pid, info.uid, info.ppid, info.starttime) == (12345, 1000, 500, 987654)
    assert info.command == "python3 train.py --lr 3e-4"
    assert info.user == user_name(1000)


def test_comm_with_parentheses_and_no_argv(proc: Path) -> None:
    info = process_info(777, proc)
    assert info is not None
    assert info.ppid == 12345
    assert info.command == "weird ) name (x"


def test_gone_process(proc: Path) -> None:
    assert process_info(99999, proc) is None
    assert start_time(99999, proc) is None
    assert ancestors(99999, proc) == []


def test_start_time_and_ancestors(proc: Path) -> None:
    assert start_time(12345, proc) == 987654
    assert ancestors(777, proc) == [12345, 500, 1]
    assert ancestors(1, proc) == []


def test_ancestors_stop_at_a_vanished_parent_and_at_loops(tmp_path: Path) -> None:
    fake_proc(tmp_path, 10, 9)  # 9 does not exist
    assert ancestors(10, tmp_path) == [9]
    fake_proc(tmp_path, 20, 21)
    fake_proc(tmp_path, 21, 20)
    assert ancestors(20, tmp_path) == [21]


def test_short_command_truncates() -> None:
    long = ["/opt/venv/bin/python", "-m", "x" * 200]
    text = short_command(long)
    assert len(text) == 80 and text.endswith("…") and text.startswith("python -m ")
    assert short_command([], "kworker/0:1") == "kworker/0:1"


def test_user_name_without_passwd_entry() -> None:
    assert user_name(4_000_000_000) == "4000000000"


def test_real_proc_for_this_process() -> None:
    info = process_info(os.getpid())
    assert info is not None
    assert info.uid == os.getuid()
    assert info.ppid == os.getppid()
    assert start_time(os.getpid()) == info.starttime
    assert ancestors(os.getpid())[0] == os.getppid()
