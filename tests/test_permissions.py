"""Every rule of who may see or do what (brokerd/core/permissions.py), one row each, with the
exact refusal a user reads; that the service applies them before anything else happens;
and that no other part of the daemon decides permissions."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from brokerd.base.process import Holder, Identity, ProcessId
from brokerd.base.procinfo import start_time
from brokerd.config.loader import Config
from brokerd.contract import Requirement
from brokerd.core.permissions import RULES, Action, Permissions
from brokerd.core.service import BrokerService
from brokerd.devices.model import Device, Snapshot
from brokerd.leasing.errors import Ended, NotFound, PermissionDenied
from brokerd.leasing.model import REVOKED, Lease
from brokerd.state.store import LeaseStore

ROOT = Path(__file__).resolve().parent.parent

ALICE = Holder(1001, 1001, 500, 11, "alice")
CALLERS = {
    "holder": Identity(1001, 1001, 500, 11),
    "same user": Identity(1001, 1001, 501, 12),  # a torchrun rank, a `vaccel run` child
    "other user": Identity(1002, 1002, 600, 22),
    "admin": Identity(1003, 1003, 700, 33),
    "member": Identity(0, 0, 800, 44),  # container root that joined the lease: uid 0 to the host
}
LEASE = Lease("l-1", ALICE, ("GPU-0",), "cuda", 0.0, members={ProcessId(800, 44)})
BELONGS = "lease l-1 belongs to alice"
ALL = {"holder", "same user", "other user", "admin", "member"}

# action -> (who may, what everyone else reads)
TABLE: dict[Action, tuple[set[str], str]] = {
    Action.ACQUIRE: (ALL, ""),
    Action.CHECK: (ALL, ""),
    Action.STATUS: (ALL, ""),
    Action.LIST_OWN: (ALL, ""),
    Action.LIST_ALL: ({"admin"}, "--all lists every user's leases: only root and members of the admin group "
                                 "'vaccel-admin' may; `vaccel status` shows who holds each device"),
    Action.GET: ({"holder", "same user", "admin", "member"}, BELONGS),
    Action.HEARTBEAT: ({"holder", "same user", "member"}, BELONGS),
    Action.JOIN: ({"holder", "same user"}, f"{BELONGS}; only its holder's processes may join it (and those of the "
                                           "container it was applied to)"),
    Action.ATTACH: ({"holder", "same user"}, f"{BELONGS}; only they may apply it to a container"),
    Action.RELEASE: ({"holder", "same user", "admin"},
                     f"{BELONGS}; only they, root or the admin group may release it"),
    Action.DRAIN: ({"admin"}, "draining devices is for root and the 'vaccel-admin' group"),
    Action.REPORT: (ALL, ""),
    Action.REPORT_OTHERS: ({"admin"}, "other users' rows are for root and the 'vaccel-admin' group"),
}


def permissions(lookups: list[int] | None = None) -> Permissions:
    def is_admin(identity: Identity) -> bool:
        if lookups is not None:
            lookups.append(identity.uid)
        return identity == CALLERS["admin"]

    return Permissions(is_admin, lambda: "vaccel-admin")


def test_the_table_covers_every_action():
    assert set(RULES) == set(Action) == set(TABLE)


@pytest.mark.parametrize("action", list(Action), ids=lambda a: a.value)
@pytest.mark.parametrize("who", sorted(CALLERS))
def test_rule(action: Action, who: str):
    allowed, refusal = TABLE[action]
    if who in allowed:
        permissions().require(action, CALLERS[who], LEASE)
        return
    with pytest.raises(PermissionDenied) as info:
        permissions().require(action, CALLERS[who], LEASE)
    assert str(info.value) == refusal
    assert info.value.kind == "permission_denied"


def test_a_process_of_the_leases_container_may_join_whatever_its_uid():
    """Container root is uid 0 to the host: it joins because the service found it in the
    lease's container (`inside`), not because of its uid; and nothing else it may do besides."""
    root_inside = Identity(0, 0, 900, 55)
    permissions().require(Action.JOIN, root_inside, LEASE, inside=True)
    with pytest.raises(PermissionDenied):
        permissions().require(Action.JOIN, root_inside, LEASE)
    for action in (Action.HEARTBEAT, Action.RELEASE, Action.ATTACH):
        with pytest.raises(PermissionDenied):
            permissions().require(action, root_inside, LEASE, inside=True)


def test_an_unnamed_holder_is_shown_by_uid():
    unnamed = Lease("l-2", Holder(1001, 1001, 500, 11), ("GPU-0",), "cuda", 0.0)
    with pytest.raises(PermissionDenied, match=r"^lease l-2 belongs to 1001$"):
        permissions().require(Action.HEARTBEAT, CALLERS["other user"], unnamed)


def test_admin_rights_are_looked_up_only_when_a_rule_needs_them():
    lookups: list[int] = []
    perms = permissions(lookups)
    perms.require(Action.HEARTBEAT, CALLERS["holder"], LEASE)
    perms.require(Action.RELEASE, CALLERS["same user"], LEASE)
    perms.require(Action.STATUS, CALLERS["other user"])
    assert lookups == []
    perms.require(Action.RELEASE, CALLERS["admin"], LEASE)
    assert lookups == [1003]


# Users that exist nowhere, so no admin group can hold them; the test process stands in
# for their processes (the broker watches it, and it stays alive).
ALICE_UID, BOB_UID = 4_000_001, 4_000_002


def as_uid(uid: int) -> Identity:
    return Identity(uid, uid, os.getpid(), start_time(os.getpid()) or 0)


def test_the_service_asks_before_it_acts(tmp_path: Path):
    """Through BrokerService: refusals change nothing; a missing or ended lease is reported
    as such before any permission question; root revokes."""

    async def scenario() -> None:
        store = LeaseStore(tmp_path)
        store.open()
        device = Device(0, "GPU-0", "nvidia", "card", 1024, "cuda", "sm_80", simulated=True)
        service = BrokerService(Config(state_dir=tmp_path), store, Snapshot((device,), simulated=True))
        service.restore([], [])
        alice, bob = as_uid(ALICE_UID), as_uid(BOB_UID)
        try:
            updates = service.acquire(alice, Requirement(1), wait=False, max_wait_s=None)
            lease = await anext(updates)
            assert isinstance(lease, Lease)
            owner = f"lease {lease.id} belongs to {ALICE_UID}"
            for refused in (service.heartbeat(bob, lease.id), service.join(bob, lease.id),
                            service.release(bob, lease.id), service.drain(bob, "gpu0", "", False)):
                with pytest.raises(PermissionDenied):
                    await refused
            with pytest.raises(PermissionDenied, match=f"^{re.escape(owner)}$"):
                service.get(bob, lease.id)
            with pytest.raises(PermissionDenied, match="--all"):
                service.leases(bob, everyone=True)
            assert service.leases(bob) == []
            assert lease.active and lease.members == set() and service.status(bob).devices[0].state == "leased"
            with pytest.raises(NotFound):
                service.get(bob, "l-nope")
            assert service.get(alice, lease.id) is lease
            assert service.leases(alice) == [lease]
            revoked = await service.release(as_uid(0), lease.id, "maintenance")
            assert revoked.state == REVOKED
            with pytest.raises(Ended):
                await service.heartbeat(bob, lease.id)
            await updates.aclose()
        finally:
            await service.close()
            store.close()

    asyncio.run(scenario())


def test_only_the_service_consults_permissions_and_only_the_table_refuses():
    daemon = ROOT / "brokerd"
    importers = sorted(p.relative_to(daemon).as_posix() for p in daemon.rglob("*.py")
                       if re.search(r"^from brokerd\.core\.permissions import", p.read_text(), re.MULTILINE))
    assert importers == ["core/service.py"]
    raisers = sorted(p.relative_to(daemon).as_posix() for p in daemon.rglob("*.py")
                     if "raise PermissionDenied(" in p.read_text())
    assert raisers == ["core/permissions.py"]
    servicer = (daemon / "edge" / "servicer.py").read_text()
    assert "is_admin" not in servicer and ".manager" not in servicer
