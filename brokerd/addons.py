"""The optional parts of the daemon, wired in one place: the lease hooks (brokerd/
lease_hooks.py) that follow every lease, and the extra servers (metrics, dashboard)
that start beside the gRPC socket. Each part reads its own config section; a part that
is off adds nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from brokerd.config import Config
from brokerd.lease_hooks import LeaseHook

if TYPE_CHECKING:
    from brokerd.service import BrokerService

Closer = Callable[[], Awaitable[None]]


def lease_hooks(config: Config, service: BrokerService) -> list[LeaseHook]:
    """The hooks, in the order they run at each moment (gating first: a grant it refuses
    must not reach the others)."""
    hooks: list[LeaseHook] = []
    return hooks


async def start_servers(config: Config, service: BrokerService) -> list[Closer]:
    """Start the extra servers the config turns on; return how to stop each."""
    closers: list[Closer] = []
    return closers
