"""The lease hook of enforcement: the lease table, made true on the device nodes.

- restored: before anyone is served, each gated node's named-user entries become exactly
  the holders of the restored leases there (entries left by a crash, by hand or by a
  desktop's seat manager go; missing ones come back).
- granted: before the holder hears of the grant, its uid gets a read-write entry on every
  node of the leased devices. A failure undoes what this grant added and refuses it:
  never a grant without its ACL.
- ended: the entries go at once, before the freed devices can be granted again; then what
  the old holder still has open there is stopped: SIGTERM, and SIGKILL `enforce.grace`
  later. A released lease first gets that grace to let go: its holder asked for the end
  and is usually exiting (a script leaving `with vaccel.lease():` has the device open
  until it exits).
- every probe interval, a sweep does the restored step again (a driver reload makes new
  nodes without the entries) and looks for processes holding a gated node without a lease
  there (opened before enforcement began, or handed over by a holder): each is reported
  once and, with `probe.unleased_processes = "signal"`, stopped like the above once seen
  for `probe.unleased_grace`. System accounts (a driver's persistence daemon) are only
  reported, root's processes neither.
- a device whose node such a process holds is not granted until it lets go, and at
  start-up what still holds a node for a lease that has ended (while the daemon was down,
  or in its last moments) is stopped as that end would have stopped it, before anyone is
  served (brokerd/addons/enforce/holds.py).

Everything that touches the lease table runs on the event loop (ACL calls are a getxattr
and a setxattr); only the /proc scans run on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from brokerd.addons.enforce import acl
from brokerd.addons.enforce.holds import grace_left, held_open, in_words, leftover_of
from brokerd.addons.enforce.openers import Opener, find_openers, first_login_uid
from brokerd.base.journal import log_event
from brokerd.base.process import ProcessId
from brokerd.base.procinfo import user_name
from brokerd.core.inventory import BusyHolder
from brokerd.core.reaper import signal_all
from brokerd.core.service import BrokerService
from brokerd.devices.model import Device
from brokerd.devices.nodes import gate_problem, holds_back, node_id
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.model import RELEASED, Lease

log = logging.getLogger("vaccel.brokerd")
Scan = Callable[[], list[Opener]]  # a /proc scan, run on a thread


class GateError(Exception):
    """A grant cannot be made real on its device nodes; the message says why."""


class DeviceGate(LeaseHook):
    name = "device gate"

    def __init__(self, service: BrokerService) -> None:
        self.service = service
        self._open: dict[str, tuple[Lease, tuple[str, ...]]] = {}  # lease id -> its nodes, opened for its holder
        self._closing: Counter[tuple[int, str]] = Counter()  # (uid, node) an ended lease's processes let go of
        self._stopping: set[ProcessId] = set()
        self._seen: dict[ProcessId, float] = {}  # unleased opener -> first sighting
        self._tasks: set[asyncio.Task[None]] = set()
        self._system_below = first_login_uid()

    # -- the three moments -------------------------------------------------------------

    def restored(self, active: Sequence[Lease]) -> None:
        self._open = {lease.id: (lease, self._nodes(lease)) for lease in active}
        self.reconcile()
        devices = sorted(self.service.manager.devices.values(), key=lambda d: d.index)
        ungated = [f"{d.label} ({why})" for d in devices if (why := holds_back(d))]
        log_event("gate", f"enforcement on: {sum(not gate_problem(d) for d in devices)} device(s) gated"
                  + (f"; not gated, so never granted: {', '.join(ungated)}" if ungated else ""),
                  level=logging.WARNING if ungated else logging.INFO)
        self._stop_leftovers()
        self._spawn(self._sweep_forever())

    def granted(self, lease: Lease) -> None:
        for uuid in lease.devices:
            device = self.service.manager.devices.get(uuid)
            problem = "it left the inventory" if device is None else holds_back(device)
            if problem:
                name = uuid if device is None else device.label
                raise GateError(f"{name} is not gated ({problem}): not granted while enforcement is on")
        nodes = self._nodes(lease)
        self._open[lease.id] = (lease, nodes)
        done: list[str] = []
        try:
            for path in nodes:
                self._apply(path)
                done.append(path)
        except acl.AclError as exc:
            del self._open[lease.id]
            for path in done:
                with contextlib.suppress(acl.AclError):
                    self._apply(path)
            raise GateError(f"could not open its device node for {lease.holder.user}: {exc}") from exc
        alone = "alone" if lease.holder.uid else "(root opens every node anyway)"
        log_event("gate", f"{', '.join(nodes)} opened for {lease.holder.user} {alone}", lease_id=lease.id,
                  user=lease.holder.user, device_uuids=lease.devices)

    def ended(self, lease: Lease) -> None:
        entry = self._open.pop(lease.id, None)
        if entry is None:
            return  # never opened (its grant was refused)
        nodes = entry[1]
        for path in nodes:
            try:
                self._apply(path)
            except acl.AclError as exc:
                log_event("gate", f"could not close {path} to {lease.holder.user}: {exc}; the sweep tries again",
                          lease_id=lease.id, user=lease.holder.user, level=logging.ERROR)
        log_event("gate", f"{', '.join(nodes)} closed to {lease.holder.user} (lease {lease.state})",
                  lease_id=lease.id, user=lease.holder.user, device_uuids=lease.devices)
        if lease.holder.uid != 0 and nodes:
            self._spawn(self._stop_old_holder(lease, nodes))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- the nodes ---------------------------------------------------------------------

    def _nodes(self, lease: Lease) -> tuple[str, ...]:
        devices = self.service.manager.devices
        return tuple(path for uuid in lease.devices if uuid in devices for path in devices[uuid].device_nodes)

    def _wanted(self, path: str) -> set[int]:
        """The uids `path` is open for: the holders of the leases on it (root needs none)."""
        return {lease.holder.uid for lease, nodes in self._open.values() if path in nodes and lease.holder.uid}

    def _apply(self, path: str) -> tuple[set[int], set[int]]:
        return acl.set_users(path, self._wanted(path))

    def reconcile(self) -> None:
        """Every node of the inventory and of the open leases, made to match the leases."""
        manager = self.service.manager
        for lease_id in [lid for lid in self._open if lid not in manager.leases]:
            del self._open[lease_id]  # ended without a word to the hooks: nothing is open for it
        paths = {p for d in manager.devices.values() for p in d.device_nodes}
        paths |= {p for _, nodes in self._open.values() for p in nodes}
        for path in sorted(paths):
            if node_id(path) is None:
                continue  # not there: its device is not granted (nodes.py)
            try:
                added, removed = self._apply(path)
            except acl.AclError as exc:
                log_event("gate", f"cannot reconcile {path}: {exc}", level=logging.ERROR)
                continue
            for uid in sorted(removed):
                log_event("gate", f"removed the ACL entry of {user_name(uid)} on {path}: no lease there",
                          user=user_name(uid), level=logging.WARNING)
            for uid in sorted(added):
                log_event("gate", f"put back the ACL entry of {user_name(uid)} on {path}: their lease holds it",
                          user=user_name(uid), level=logging.WARNING)

    # -- stopping what still holds a node ----------------------------------------------

    async def _stop_old_holder(self, lease: Lease, nodes: tuple[str, ...]) -> None:
        uid, user = lease.holder.uid, lease.holder.user
        keys = [(uid, path) for path in nodes]
        self._closing.update(keys)
        try:
            if lease.state == RELEASED:
                await asyncio.sleep(self.service.config.enforce_grace_s)
            also = [p.pid for p in self.service.snapshot.processes if p.device_uuid in lease.devices]

            def scan() -> Scan:
                # A node the same user holds again (a new lease on that device) is theirs again.
                ids = [i for path in nodes if uid not in self._wanted(path) and (i := node_id(path))]
                return lambda: find_openers(ids, uid=uid, also=also) if ids else []

            await self._stop(scan, f"it still had the device open after lease {lease.id} ended ({lease.state})",
                             lease_id=lease.id, user=user, device_uuids=lease.devices)
        finally:
            self._closing.subtract(keys)
            self._closing = +self._closing

    async def _stop(self, scan: Callable[[], Scan], why: str, claimed: frozenset[ProcessId] = frozenset(),
                    **fields: Any) -> None:
        """SIGTERM to what a scan finds, SIGKILL `enforce.grace` later to what a second one
        finds. `scan()` runs on the loop (it reads the lease table) and returns the /proc
        scan to run on a thread. `claimed`: processes the caller marked as being stopped."""
        loop = asyncio.get_running_loop()
        stopping: set[ProcessId] = set(claimed)
        try:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                found = await loop.run_in_executor(None, scan())
                if not found:
                    return
                stopping |= {o.process for o in found}
                self._stopping |= stopping
                hit = set(await loop.run_in_executor(None, signal_all, [o.process for o in found], sig))
                for o in found:
                    if o.process in hit:
                        log_event("gate", f"{sig.name} to {o.user}'s pid {o.process.pid} ({o.command}): {why}",
                                  pid=o.process.pid, signal=sig.name, level=logging.WARNING, **fields)
                if sig == signal.SIGTERM:
                    await asyncio.sleep(self.service.config.enforce_grace_s)
        except Exception as exc:  # stopping must never take the daemon down
            log_event("gate", f"could not stop what holds a gated node: {exc}", level=logging.ERROR)
        finally:
            self._stopping -= stopping

    # -- what holds a node without a lease -----------------------------------------------

    def _gated(self) -> dict[str, Device]:
        return {d.uuid: d for d in self.service.manager.devices.values() if not gate_problem(d)}

    def _hold(self, found: list[Opener], devices: dict[str, Device]) -> None:
        held = held_open(found, self._wanted, devices.values(), self._system_below)
        self.service.hold_back(self.name, {uuid: in_words(*it) for uuid, it in held.items()},
                               {uuid: BusyHolder(o.user, o.process.pid, o.command) for uuid, (o, _) in held.items()})

    def _stop_leftovers(self) -> None:
        """At start-up, before anyone is served: the devices held open without a lease are
        held back, and what holds them for a lease that has ended is stopped. The scan runs
        here, on the loop, which has nobody to serve yet."""
        devices = self._gated()
        ids = [i for d in devices.values() for path in d.device_nodes if (i := node_id(path))]
        found = find_openers(ids) if ids else []
        self._hold(found, devices)
        now, grace = time.time(), self.service.config.enforce_grace_s
        for o in found:
            if o.uid < self._system_below or all(o.uid in self._wanted(path) for path in o.nodes):
                continue
            lease = leftover_of(o, self.service.manager.ended.values(), devices)
            if lease is None:
                continue  # it opened the node some other way: the sweep's rules apply
            self._stopping.add(o.process)

            def scan(pid: int = o.process.pid, uid: int = o.uid) -> Scan:
                return lambda: find_openers(ids, uid=uid, only=[pid])

            why = f"it still had the device open after lease {lease.id} ended ({lease.state}) before this start"
            self._spawn(self._stop_after(grace_left(lease, grace, now), scan, why, frozenset({o.process}),
                                         lease_id=lease.id, user=o.user, device_uuids=lease.devices))

    async def _stop_after(self, delay_s: float, scan: Callable[[], Scan], why: str, claimed: frozenset[ProcessId],
                          **fields: Any) -> None:
        await asyncio.sleep(delay_s)
        await self._stop(scan, why, claimed, **fields)

    # -- the sweep ---------------------------------------------------------------------

    async def _sweep_forever(self) -> None:
        while True:
            try:
                self.reconcile()
                await self._look_for_unleased()
            except Exception:
                log.exception("device gate: the sweep failed; trying again at the next one")
            await asyncio.sleep(max(1.0, self.service.config.probe_interval_s))

    def _unleased(self, opener: Opener) -> bool:
        if opener.process in self._stopping:
            return False
        return any(opener.uid not in self._wanted(path) and not self._closing[(opener.uid, path)]
                   for path in opener.nodes)

    async def _look_for_unleased(self) -> None:
        devices = self._gated()
        ids = [i for d in devices.values() for path in d.device_nodes if (i := node_id(path))]
        found = await asyncio.get_running_loop().run_in_executor(None, lambda: find_openers(ids)) if ids else []
        self._hold(found, devices)
        config, now = self.service.config, time.time()
        unleased = [o for o in found if self._unleased(o)]  # judged now: the scan took a while
        self._seen = {o.process: self._seen.get(o.process, now) for o in unleased}
        for o in unleased:
            system = o.uid < self._system_below
            if self._seen[o.process] == now:
                log_event("gate", f"{o.user}'s pid {o.process.pid} ({o.command}) holds {', '.join(o.nodes)} "
                          "without a lease there (opened before enforcement began, or handed over)"
                          + ("; a system account: only reported" if system else ""),
                          user=o.user, pid=o.process.pid, level=logging.WARNING)
            if config.unleased_processes == "signal" and not system and now - self._seen[o.process] >= \
                    config.unleased_grace_s:
                self._stopping.add(o.process)

                def scan(pid: int = o.process.pid, uid: int = o.uid) -> Scan:
                    return lambda: find_openers(ids, uid=uid, only=[pid])

                self._spawn(self._stop(scan, "it held a gated device node without a lease there",
                                       frozenset({o.process}), user=o.user))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro, name="device gate")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
