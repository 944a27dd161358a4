"""The Status reply is built once per change (or per second) and served to every poller;
a grant, a release, a newcomer in the queue or a drain is seen at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from brokerd.contract import Requirement
from brokerd.edge.status_cache import MAX_AGE_S, StatusCache
from tests.test_service import gpus, open_service
from tests.test_service import me as current_process


def test_one_reply_serves_every_poller_until_the_state_or_the_second_changes(tmp_path: Path):
    async def scenario() -> None:
        store, service = open_service(tmp_path, gpus(2))
        now = [100.0]
        cache = StatusCache(clock=lambda: now[0])
        builds: list[int] = []

        me = current_process()

        def reply():
            def build():
                builds.append(1)
                return object()
            return cache.reply(service, me, build)  # type: ignore[arg-type]

        try:
            first = reply()
            assert reply() is first and len(builds) == 1  # nothing changed: the same reply
            lease = await service.acquire_now(me, Requirement(2), command="hold both")
            assert reply() is not first and len(builds) == 2  # a grant is seen at once
            granted = reply()
            waiting = service.acquire(me, Requirement(1), wait=True, max_wait_s=None, command="later", key="k1")
            assert (await anext(waiting)).position == 1
            assert reply() is not granted and len(builds) == 3  # a newcomer in the queue
            queued = reply()
            now[0] += MAX_AGE_S
            assert reply() is not queued and len(builds) == 4  # a second on: time left moved
            await service.release(me, lease.id)
            assert len(builds) == 4 and reply() is not None and len(builds) == 5  # a release, at once
            await waiting.aclose()
        finally:
            await service.close()
            store.close()

    asyncio.run(scenario())


def test_each_user_sees_their_own_use_against_the_limits_and_admins_everyones(tmp_path: Path):
    """Issue 31: device-hours are other users' history. One picture for admins, one per
    user with something to see, one shared by everyone else; each built once per change."""
    from dataclasses import replace

    from brokerd.base.process import Identity
    from brokerd.edge.messages import status_reply

    async def scenario() -> None:
        store, service = open_service(tmp_path, gpus(2))
        cache = StatusCache()
        root = current_process()
        alice = replace(root, uid=54001, gid=54001)
        bob, carol = replace(alice, uid=54002, gid=54002), Identity(54003, 54003, 1, 1)
        builds: list[int] = []

        def users_seen(identity: Identity) -> list[int]:
            def build():
                builds.append(identity.uid)
                return status_reply(service, identity)
            return [use.uid for use in cache.reply(service, identity, build).usage]

        try:
            await service.acquire_now(alice, Requirement(1), command="alice's")
            await service.acquire_now(bob, Requirement(1), command="bob's")
            assert users_seen(root) == [54001, 54002]
            assert users_seen(alice) == [54001] and users_seen(bob) == [54002]
            assert users_seen(carol) == [] and users_seen(replace(carol, uid=54004)) == []
            assert sorted(builds) == [0, 54001, 54002, 54003]  # carol's picture served the next user too
        finally:
            await service.close()
            store.close()

    asyncio.run(scenario())
