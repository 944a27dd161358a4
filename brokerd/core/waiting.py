"""The clients whose requests wait in the queue, each with a mailbox: updates on its place
in line while it waits, then the grant (or the error) that ends the wait. The lease
manager owns the queue itself; this only talks to the ones waiting in it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from brokerd.core.views import DeviceView, device_view
from brokerd.leasing.errors import LeaseError
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import Lease, Request
from vaccel_common.units import format_mib

ANNOUNCE_EVERY_S = 0.1  # the soonest a queue line follows a change; a grant is never delayed
# A pass that told N waiters waits N x this before the next one. Each line costs the loop
# ~0.15 ms (built here, then sent by its stream), so however long the queue, its lines take
# at most ~8% of the loop: at 500 waiters one pass a second instead of ten, which took most
# of the loop while grants came and went, and every grant waited behind it.
LINE_SPACING_S = 0.002


@dataclass(frozen=True)
class QueuedUpdate:
    """Where a waiting request stands: `position` of `total`, in words, and what is held."""

    position: int
    total: int
    message: str
    held: tuple[DeviceView, ...]  # the devices leased right now
    request_id: str = ""


@dataclass
class Mailbox:
    """One waiting client's: read only by that client's acquire stream."""

    items: asyncio.Queue[QueuedUpdate | Lease | LeaseError] = field(default_factory=asyncio.Queue)
    last_seen: tuple[int, str] = (0, "")  # place, reason it waits: (0, "") before its first line

    async def receive(self, timeout: float | None) -> QueuedUpdate | Lease:
        """The next update or the grant; raises the error posted, or TimeoutError."""
        item = await asyncio.wait_for(self.items.get(), timeout)
        if isinstance(item, LeaseError):
            raise item
        return item

    def unread_grants(self) -> list[Lease]:
        """Empty the mailbox: the grants in it, which its client will never read."""
        grants = []
        while not self.items.empty():
            item = self.items.get_nowait()
            if isinstance(item, Lease):
                grants.append(item)
        return grants


class WaitingRoom:
    """The mailboxes of the requests waiting now, by request id."""

    def __init__(self) -> None:
        self._boxes: dict[str, Mailbox] = {}
        self._scheduled: asyncio.TimerHandle | None = None
        self._next_pass_at = 0.0  # loop time before which the last pass says to wait
        self._held: tuple[DeviceView, ...] = ()  # the last lines' held devices

    def open(self, request_id: str) -> Mailbox:
        """A mailbox for the request's waiter. A waiter that came back on a new stream
        replaces its old one, whose stream is told to stop."""
        old = self._boxes.get(request_id)
        if old is not None:
            old.items.put_nowait(LeaseError("this request was taken up again by a newer stream"))
        box = self._boxes[request_id] = Mailbox()
        return box

    def attached(self, request_id: str) -> bool:
        """Whether someone is waiting on a stream for this request."""
        return request_id in self._boxes

    def close(self, request_id: str, last_word: QueuedUpdate | None = None, *, box: Mailbox | None = None) -> bool:
        """Nothing more will be posted for this request; `last_word` is its final item.
        With `box`: only if that is still the request's mailbox; False when it was not."""
        current = self._boxes.get(request_id)
        if current is None or (box is not None and current is not box):
            return box is None
        del self._boxes[request_id]
        if last_word is not None:
            current.items.put_nowait(last_word)
        return True

    def post(self, request_id: str, item: Lease | LeaseError) -> bool:
        """Hand a grant or an error to the waiter; False when nobody waits for it any more."""
        box = self._boxes.get(request_id)
        if box is not None:
            box.items.put_nowait(item)
        return box is not None

    def announce(self, manager: LeaseManager) -> None:
        """Tell each waiter whose own place in the queue, or whose reason to wait, changed
        where it stands, within ANNOUNCE_EVERY_S: changes in that time make one pass. (Not
        when only the queue's length changed: on a busy server those lines filled job logs.)
        On a large host every grant and every newcomer moves every waiter's line, and
        telling 500 waiters at once delayed the grant itself; a grant, an error and a
        newcomer's first place (`tell`) are never delayed. A long queue is told less often
        (LINE_SPACING_S)."""
        if self._scheduled is None and self._boxes:
            loop = asyncio.get_running_loop()
            delay = max(ANNOUNCE_EVERY_S, self._next_pass_at - loop.time())
            self._scheduled = loop.call_later(delay, self._announce_now, manager)

    def tell(self, manager: LeaseManager, request_id: str) -> None:
        """Tell one waiter where it stands, now (it has just joined, or come back)."""
        box = self._boxes.get(request_id)
        place = next((i for i, r in enumerate(manager.queue, start=1) if r.id == request_id), 0)
        if box is not None and place:
            self._send(manager, [(place, manager.queue[place - 1], box)])

    def _announce_now(self, manager: LeaseManager) -> None:
        self._scheduled = None
        # One pass: asking the manager for each request's place would make this quadratic
        # in the queue's length.
        told = self._send(manager, [(place, request, self._boxes[request.id])
                                    for place, request in enumerate(manager.queue, start=1)
                                    if request.id in self._boxes])
        self._next_pass_at = asyncio.get_running_loop().time() + told * LINE_SPACING_S

    def _send(self, manager: LeaseManager, lines: list[tuple[int, Request, Mailbox]]) -> int:
        """Post a line to each waiter whose place or reason changed; how many. A waiter's
        first line also says who holds what; later ones only where it stands (a holders
        line at every move was ~200 characters of what `vaccel status` shows)."""
        total = len(manager.queue)
        changed = [(place, r, box) for place, r, box in lines if (place, r.reason) != box.last_seen]
        if not changed:
            return 0
        devices = manager.devices
        held = tuple(device_view(manager, devices[uuid]) for uuid in (*manager.owner, *manager.holdings.shares)
                     if uuid in devices)
        # Newcomers share one tuple while nothing held changed: each waiter keeps its last
        # line while it waits, and 64 views each was ~8 KB a waiter.
        if held == self._held:
            held = self._held
        else:
            self._held = held
        summary = manager.holders_summary() if any(box.last_seen == (0, "") for _, _, box in changed) else ""
        for place, request, box in changed:
            first = box.last_seen == (0, "")
            box.last_seen = (place, request.reason)
            n = request.requirement.gpus
            # Say why it waits (the pump left the reason on it): else a student sees
            # "position 1" for ever and does not know a limit or their own lease holds it.
            why = f" ({request.reason})" if request.reason else ""
            what = f"a {format_mib(request.ask.memory_mib)} share" if request.ask.memory_mib else \
                f"{n} GPU{'s' if n > 1 else ''}"
            message = f"waiting for {what}: position {place} of {total}{why}" + (f"; {summary}" if first else "")
            box.items.put_nowait(QueuedUpdate(place, total, message, held, request.id))
        return len(changed)
