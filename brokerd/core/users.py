"""Users as the broker shows and judges them: names and admin rights, cached (both lookups
may go to LDAP/sssd, and they sit on every request's path; names change rarely, group
membership a little more often and matters more), and the holder record other users see.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import time
from collections.abc import Callable

from brokerd.base.groups import BOOK
from brokerd.base.process import Holder, Identity
from brokerd.base.procinfo import in_another_pid_namespace, process_info, user_name

NAME_TTL_S = 300.0
ADMIN_TTL_S = 60.0


class UserDirectory:
    def __init__(self, admin_gid: Callable[[], int | None], clock: Callable[[], float] = time.monotonic) -> None:
        self._admin_gid = admin_gid  # read at each lookup: the admin group is reloadable
        self._clock = clock
        self._names: dict[int, tuple[str, float]] = {}
        self._admins: dict[int, tuple[bool, float]] = {}

    def name(self, uid: int) -> str:
        """The login name of `uid`, or the number as text when it has none."""
        cached = self._names.get(uid)
        now = self._clock()
        if cached is None or now - cached[1] > NAME_TTL_S:
            cached = self._names[uid] = (user_name(uid), now)
        return cached[0]

    def is_admin(self, identity: Identity) -> bool:
        """Root, the daemon's own user (a personal broker), and the admin group; never a process
        in a container (another pid namespace): its root is uid 0 to the host, not the host's root."""
        if in_another_pid_namespace(identity.pid):
            return False
        if identity.uid in (0, os.geteuid()):
            return True
        cached = self._admins.get(identity.uid)
        now = self._clock()
        if cached is not None and now - cached[1] < ADMIN_TTL_S:
            return cached[0]
        gid = self._admin_gid()
        admin = False
        if gid is not None:  # the user's groups, not the process's gid (brokerd/base/groups.py)
            with contextlib.suppress(KeyError, OSError):
                admin = gid in BOOK.of(pwd.getpwuid(identity.uid).pw_name).gids
        self._admins[identity.uid] = (admin, now)
        return admin

    def holder(self, identity: Identity, command: str) -> Holder:
        """The process as others will see it: its user's name, and the command it says it
        runs (else the one /proc shows), kept exact: whatever shows it to a person escapes
        it there (vaccel_common/text.py)."""
        shown = command
        if not shown:
            info = process_info(identity.pid)
            shown = info.command if info else ""
        return Holder.of(identity, self.name(identity.uid), shown)
