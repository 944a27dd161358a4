"""Bounded, fair, off-loop work for the calls a client can make expensive: parsing and
evaluating contract files (Acquire with a contract, Check).

Each such call runs on a small thread pool, never on the event loop, and each user may
have only `per_user` of them running and `per_user_waiting` more admitted at once; beyond
that the call is refused at once (RESOURCE_EXHAUSTED) instead of piling up. One user's
flood therefore occupies at most `per_user` of the pool's threads and the loop keeps
serving everyone else.

A thread (not a worker process) is enough because the inputs are bounded before any work
starts (brokerd/contract/located.py: 256 KiB, no aliases, depth 32, 20,000 values), so one
call costs milliseconds in libyaml and a bounded amount of memory; the loop keeps getting
the GIL at every switch interval. A process would add a pickling round trip per request
for no gain in what a hostile input can cost. docs/security.md has the measurements.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from brokerd.contract import Requirement, evaluate
from brokerd.contract.convert import requirement_from_request
from brokerd.devices.model import Device
from brokerd.leasing.errors import Busy

T = TypeVar("T")
_KNOWN_MAX = 32  # requirements remembered; a flood of distinct ones just starts over
_KNOWN_INPUT_MAX = 64 * 1024  # and only those made from this much input at most: bounded memory


class WorkGuard:
    def __init__(self, *, workers: int = 4, per_user: int = 2, per_user_waiting: int = 6) -> None:
        self.per_user = per_user
        self.per_user_waiting = per_user_waiting
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                           thread_name_prefix="vaccel-contract")
        self._admitted: dict[int, int] = {}  # uid -> calls running or waiting for a slot
        self._running: dict[int, int] = {}  # uid -> calls whose thread work is not finished
        self._freed = asyncio.Condition()
        # Parsed-and-evaluated requirements by everything they depend on, for the devices
        # they were evaluated against: a training script asks the same thing every time,
        # and evaluating 64 devices was the largest cost of an acquire on a large host.
        self._known: dict[tuple[object, ...], Requirement] = {}
        self._known_devices: object = None
        # The loop thread waits up to one switch interval for the GIL each time it wakes
        # while a contract thread computes; 1 ms instead of 5 keeps its replies prompt.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))

    async def run(self, uid: int, fn: Callable[[], T]) -> T:
        """`fn()` on the pool, within the caller's user's share. Raises Busy when the user
        already has as many calls admitted as allowed. A call whose client left keeps its
        slot until its thread is done, so cancelling and retrying gains nothing."""
        admitted = self._admitted.get(uid, 0)
        if admitted >= self.per_user + self.per_user_waiting:
            raise Busy(f"too many contract checks at once from this user ({admitted} in progress); "
                       "wait for them to finish")
        self._admitted[uid] = admitted + 1
        try:
            async with self._freed:
                await self._freed.wait_for(lambda: self._running.get(uid, 0) < self.per_user)
                self._running[uid] = self._running.get(uid, 0) + 1
            future = asyncio.get_running_loop().run_in_executor(self._pool, fn)
            future.add_done_callback(lambda _: asyncio.ensure_future(self._release(uid)))
            return await asyncio.shield(future)
        finally:
            left = self._admitted[uid] - 1
            if left:
                self._admitted[uid] = left
            else:
                del self._admitted[uid]

    async def _release(self, uid: int) -> None:
        async with self._freed:
            left = self._running[uid] - 1
            if left:
                self._running[uid] = left
            else:
                del self._running[uid]
            self._freed.notify_all()

    async def requirement(self, uid: int, request: object, devices: Sequence[Device], *,
                          check: bool = False) -> Requirement:
        """Parse the request's contract files and evaluate them against `devices`, off the
        loop when there is a file to parse (the evaluation is remembered on the result, so
        the lease manager's and Check's own `evaluate` find it). An equal request against
        the same devices (the same `devices` object: the inventory did not change) gets
        the requirement already made."""
        r: Any = request
        gpus, memory = (max(r.gpus, 1), max(r.min_memory_mib, 0)) if check else (r.gpus, r.min_memory_mib)
        key = (gpus, memory, r.runtime_spec_yaml, r.runtime_spec_name, r.accelerator_config_yaml,
               r.accelerator_config_name, r.client.SerializeToString(deterministic=True))
        if self._known_devices is not devices:
            self._known, self._known_devices = {}, devices
        known = self._known.get(key)
        if known is not None:
            return known
        snapshot = list(devices)

        def work() -> Requirement:
            requirement = requirement_from_request(
                gpus, memory, r.runtime_spec_yaml, r.runtime_spec_name or "runtime-spec.yaml",
                r.accelerator_config_yaml, r.accelerator_config_name or "accelerator-config.yaml", r.client)
            evaluate(requirement, snapshot)
            return requirement

        if not (r.runtime_spec_yaml or r.accelerator_config_yaml):
            made = work()  # nothing to parse: cheaper than the hop to a thread
        else:
            made = await self.run(uid, work)
        size = len(r.runtime_spec_yaml) + len(r.accelerator_config_yaml) + len(key[-1])
        if self._known_devices is devices and size <= _KNOWN_INPUT_MAX:  # else the inventory changed
            if len(self._known) >= _KNOWN_MAX:
                self._known.clear()
            self._known[key] = made
        return made

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
