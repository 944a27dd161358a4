"""Which process is which: the key that tells a process apart from a later one reusing
its pid, the kernel's identity of a caller, and a lease holder (that identity plus what
other users are shown about it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class ProcessId(NamedTuple):
    """One process for its whole life. A pid alone is reused after exit; together with the
    start time (/proc/<pid>/stat field 22) it names exactly one process. A tuple, so the
    store keeps it as `[pid, start_time]` and it sorts without help."""

    pid: int
    start_time: int


@dataclass(frozen=True)
class Identity:
    """A process as the kernel identified it at connect time (SO_PEERCRED plus its start
    time), never as a client described itself."""

    uid: int
    gid: int
    pid: int
    start_time: int

    @property
    def process(self) -> ProcessId:
        return ProcessId(self.pid, self.start_time)


@dataclass(frozen=True)
class Holder(Identity):
    """The process a lease or a queued request belongs to, plus what to show about it."""

    user: str = ""
    command: str = ""

    @classmethod
    def of(cls, identity: Identity, user: str, command: str) -> Holder:
        return cls(identity.uid, identity.gid, identity.pid, identity.start_time, user, command)
