"""The interfaces add-ons plug into the core through, besides the lease hooks
(brokerd/leasing/hooks.py) and the change feed (brokerd/core/changes.py).

An Allocator decides grants instead of the broker's own queue (Slurm in delegate mode,
brokerd/addons/slurm/): the acquire path hands it every request, and the status shows
what it holds and who waits with it. It grants through the service's `adopt_grant` and
ends through `end_lease`, so the store, the hooks and the end states stay the usual ones.

A ContainerKeeper (brokerd/addons/containers/) confirms the containers leases are applied to
(`vaccel run -- docker run ...`) with their engine or the kernel, and tells whether a caller
runs in a lease's container; the core records and watches what it confirms. It stops a
container itself when its lease ends (a lease hook), and when the core asks (`stop_container`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from brokerd.base.process import Holder, Identity
from brokerd.contract import Requirement
from brokerd.core.views import OutsideStatus
from brokerd.core.waiting import QueuedUpdate
from brokerd.leasing.model import ContainerHold, Lease
from brokerd.state.report import Report


class Allocator(Protocol):
    mode: str

    def acquire(self, holder: Holder, requirement: Requirement, *, wait: bool, max_wait_s: float | None,
                **asked: Any) -> AsyncIterator[QueuedUpdate | Lease]:
        """QueuedUpdate while the request waits, then its Lease (durable)."""
        ...

    async def acquire_now(self, holder: Holder, requirement: Requirement, **asked: Any) -> Lease:
        """The Lease at once, or Busy."""
        ...

    def job_id(self, lease_id: str) -> int:
        """The allocator's own id of the allocation behind a lease, 0 = none."""
        ...

    def outside_status(self) -> OutsideStatus:
        """What it holds and who waits with it, now."""
        ...

    def version(self) -> Hashable:
        """Changes whenever `outside_status()` would (the Status reply's cache key)."""
        ...


class Reporter(Protocol):
    async def areport(self, since: float, until: float, by: str, viewer_uid: int, viewer_is_admin: bool) -> Report:
        """Usage over a period, grouped `by`; other users' rows only for an admin viewer."""
        ...

    def areport_pages(self, since: float, until: float, by: str, viewer_uid: int, viewer_is_admin: bool
                      ) -> AsyncIterator[Report]:
        """The same in pages (by lease: a page of leases at a time, each with the total)."""
        ...


@dataclass(frozen=True)
class ContainerStopped:
    """A container the broker stopped because it started outside a live lease (`vaccel status`)."""

    engine: str
    id: str
    name: str
    image: str
    reason: str  # why, in words
    at: float
    lease_id: str  # the ended lease whose label it carried, "" none
    user: str  # that lease's user, "" none


class ContainerKeeper(Protocol):
    async def confirm(self, lease: Lease, caller: Identity, container: str, init_pid: int,
                      shown: tuple[str, str]) -> ContainerHold:
        """The container `caller` says it applied `lease` to (the engine's id, or for a rootless
        engine its init's host pid), as its engine or the kernel confirms it: never on the
        caller's word. `shown` (name, image) is only shown, where no engine can be asked.
        Raises LeaseError, saying why, for a container that is not the lease's."""
        ...

    async def runs_inside(self, caller: Identity, lease: Lease) -> bool:
        """Whether the caller's process runs in the lease's container, as its engine and the
        kernel say (a process in a Docker container is uid 0 to the host: its uid tells nothing)."""
        ...

    def stop_container(self, lease: Lease) -> None:
        """Stop the lease's container (in the background): its lease ended as it was applied."""
        ...

    async def let_start(self, lease: Lease, container: str) -> None:
        """Let an existing container start under `lease` (`vaccel run -- docker start NAME`), once
        its engine shows it is the lease's user's and made with the lease's devices; LeaseError else."""
        ...

    def container_of(self, pid: int) -> str:
        """The name (else the short id) of the container a process runs in, "" none (`busy_by`)."""
        ...

    def stopped_containers(self) -> list[ContainerStopped]:
        """The containers it stopped lately for starting outside a live lease, newest last."""
        ...
