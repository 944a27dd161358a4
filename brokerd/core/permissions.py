"""Who may see or do what: every such rule of the broker, in one table (RULES below).

Each action names who may do it: anyone, the holder's user (any process of the uid that
holds the lease: torchrun ranks, `vaccel run` children, as the kernel identified them), a
member (a process that joined the lease), a process of the lease's container (as its engine
and the kernel say: the service finds that out, brokerd/core/container_holds.py), or an admin
(root, the daemon's own user for a personal broker, or a member of the configured admin group;
brokerd/core/users.py looks that up; never a process in a container). Everyone else is refused
with the rule's message. An admin's release of someone else's lease is a revoke.

The service asks `Permissions.require` before each operation it offers; nothing else in
the daemon decides who may do what (tests/test_permissions.py checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from brokerd.base.process import Identity
from brokerd.leasing.errors import PermissionDenied
from brokerd.leasing.model import Lease


class Action(Enum):
    """What a caller asks to do or to see."""

    ACQUIRE = "acquire"
    CHECK = "check"
    STATUS = "status"
    LIST_OWN = "list own"
    LIST_ALL = "list all"
    GET = "get lease"
    HEARTBEAT = "heartbeat"
    JOIN = "join"
    ATTACH = "apply a lease to a container"
    RELEASE = "release"
    DRAIN = "drain"
    REPORT = "report"
    REPORT_OTHERS = "see other users' rows in a report"


class Who(Enum):
    """Whom a rule lets through."""

    ANYONE = "anyone"
    HOLDER_USER = "the holder's user"
    MEMBER = "a process that joined the lease"
    LEASE_CONTAINER = "a process of the lease's container"
    ADMIN = "admin"


@dataclass(frozen=True)
class Rule:
    """Any of `who` may; everyone else gets `refusal`, formatted with `lease` (its id),
    `owner` (the holder's user name) and `admin_group`."""

    who: frozenset[Who]
    refusal: str = ""


_ANYONE = frozenset({Who.ANYONE})
_HOLDER_USER = frozenset({Who.HOLDER_USER})
_HOLDER_USER_OR_ADMIN = frozenset({Who.HOLDER_USER, Who.ADMIN})
_HOLDER_USER_OR_MEMBER = frozenset({Who.HOLDER_USER, Who.MEMBER})
_ADMIN = frozenset({Who.ADMIN})

RULES: Mapping[Action, Rule] = MappingProxyType({
    Action.ACQUIRE: Rule(_ANYONE),
    Action.CHECK: Rule(_ANYONE),
    # A shared host is run in the open: who holds which device and who waits is public.
    Action.STATUS: Rule(_ANYONE),
    Action.LIST_OWN: Rule(_ANYONE),
    Action.LIST_ALL: Rule(_ADMIN, (
        "--all lists every user's leases: only root and members of the admin group {admin_group!r} "
        "may; `vaccel status` shows who holds each device")),
    Action.GET: Rule(_HOLDER_USER_OR_ADMIN | {Who.MEMBER}, "lease {lease} belongs to {owner}"),
    # Keeping a lease alive is its holder's business (a member's too: container root joined it,
    # under another uid); an admin ends it instead.
    Action.HEARTBEAT: Rule(_HOLDER_USER_OR_MEMBER, "lease {lease} belongs to {owner}"),
    # Joining puts a process inside the lease: an admin has no business there either.
    Action.JOIN: Rule(_HOLDER_USER | {Who.LEASE_CONTAINER}, (
        "lease {lease} belongs to {owner}; only its holder's processes may join it (and those of the "
        "container it was applied to)")),
    Action.ATTACH: Rule(_HOLDER_USER, "lease {lease} belongs to {owner}; only they may apply it to a container"),
    Action.RELEASE: Rule(_HOLDER_USER_OR_ADMIN, (
        "lease {lease} belongs to {owner}; only they, root or the admin group may release it")),
    Action.DRAIN: Rule(_ADMIN, "draining devices is for root and the {admin_group!r} group"),
    # Totals are public like status; who used how much is personal data (docs/accounting.md),
    # shown to everyone only when accounting.per_user_report = "everyone".
    Action.REPORT: Rule(_ANYONE),
    Action.REPORT_OTHERS: Rule(_ADMIN, "other users' rows are for root and the {admin_group!r} group"),
})


class Permissions:
    """Applies RULES. Admin rights are looked up only when a rule needs them (the lookup may
    go to LDAP/sssd); the admin group's name is read at each refusal, so a reload shows."""

    def __init__(self, is_admin: Callable[[Identity], bool], admin_group: Callable[[], str]) -> None:
        self._is_admin = is_admin
        self._admin_group = admin_group

    def allows(self, action: Action, caller: Identity, lease: Lease | None = None, *, inside: bool = False) -> bool:
        """Whether `caller` may do `action` (to `lease`, where there is one); `inside`: the
        caller runs in the lease's container, as its engine and the kernel say."""
        who = RULES[action].who
        if Who.ANYONE in who:
            return True
        if lease is not None and (
                (Who.HOLDER_USER in who and caller.uid == lease.holder.uid)
                or (Who.MEMBER in who and caller.process in lease.members)
                or (Who.LEASE_CONTAINER in who and inside)):
            return True
        return Who.ADMIN in who and self._is_admin(caller)

    def require(self, action: Action, caller: Identity, lease: Lease | None = None, *, inside: bool = False) -> None:
        """Raise PermissionDenied, with the rule's message, unless `caller` may."""
        holder = lease.holder if lease is not None else None
        if self.allows(action, caller, lease, inside=inside):
            return
        raise PermissionDenied(RULES[action].refusal.format(
            lease=lease.id if lease is not None else "",
            owner=(holder.user or holder.uid) if holder is not None else "",
            admin_group=self._admin_group(),
        ))
