"""The Unix groups a user belongs to, looked up by the user, never by the asking process.

A process's gid is the process's to choose among the user's groups (`sg`, `newgrp`, a
setgid program), so limits that followed it followed the process: a user limited
through their primary group escaped with `sg other-group` (issue 31). A user's groups
are their primary group (from the passwd entry) and every group that lists them, as
getgrouplist(3) gives them, wherever the host keeps them (files, LDAP, sssd).

Both lookups may go to a directory server and sit on the request path, so each answer is
kept for TTL_S (as brokerd/core/users.py keeps names and admin rights): a user added to a
group counts within a minute, without logging in again.
"""

from __future__ import annotations

import grp
import os
import pwd
import time
from collections.abc import Callable
from dataclasses import dataclass

TTL_S = 60.0
MAX_USERS = 4096  # beyond this many cached users, start again (a host has far fewer)


@dataclass(frozen=True)
class Membership:
    primary_gid: int | None  # None: the user is unknown to the host
    gids: frozenset[int]
    names: frozenset[str]


NOBODY = Membership(None, frozenset(), frozenset())


class GroupBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._users: dict[str, tuple[Membership, float]] = {}

    def of(self, user: str) -> Membership:
        """The groups of the user named `user` (NOBODY for an unknown or empty name)."""
        if not user:
            return NOBODY
        now = self._clock()
        cached = self._users.get(user)
        if cached is not None and now - cached[1] < TTL_S:
            return cached[0]
        if len(self._users) >= MAX_USERS:
            self._users.clear()
        found = _look_up(user)
        self._users[user] = (found, now)
        return found

    def forget(self) -> None:
        """Look everyone up again (a reload: the admin may have just changed the groups)."""
        self._users.clear()


def _look_up(user: str) -> Membership:
    try:
        primary = pwd.getpwnam(user).pw_gid
        gids = frozenset(os.getgrouplist(user, primary))
    except (KeyError, OSError):
        return NOBODY
    names = set()
    for gid in gids:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except (KeyError, OverflowError):
            continue
    return Membership(primary, gids, frozenset(names))


BOOK = GroupBook()  # the daemon's one cache: the policy, admin rights and accounting ask it
