"""What the broker remembers of each waiting request besides the lease manager's queue
entry, so the queue survives a restart and a waiter cut off by one can come back to its
own place: the key its client chose, when it gives up, and the request as it arrived.

A key finds a record, but only the process that made the request (uid, pid and start
time from the kernel, as in every token) may take it up again: someone else's key only
ever leads to a fresh request of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from brokerd.base.process import Holder, Identity


@dataclass(frozen=True)
class WaitRecord:
    request_id: str
    key: str  # chosen by the client before it asked, so it knows it even if no reply came
    holder: Holder
    since: float  # wall-clock time it joined the queue
    deadline: float  # wall-clock time its waiter gives up, 0 = never
    spec: bytes  # the request as the servicer received it, to rebuild it after a restart
    lease_id: str = ""  # granted while its waiter was away, not yet delivered


class WaitRecords:
    """The records of the requests in the queue and of grants not yet delivered."""

    def __init__(self) -> None:
        self._by_id: dict[str, WaitRecord] = {}
        self._by_key: dict[tuple[int, str], str] = {}  # (uid, key) -> request id
        # lease id -> request id, for the grants kept for a waiter who was away: each end
        # of a lease asks (one look-up, not a pass over every waiting request's record).
        self._by_lease: dict[str, str] = {}

    def add(self, record: WaitRecord) -> None:
        self._by_id[record.request_id] = record
        if record.key:
            self._by_key[(record.holder.uid, record.key)] = record.request_id
        if record.lease_id:
            self._by_lease[record.lease_id] = record.request_id

    def get(self, request_id: str) -> WaitRecord | None:
        return self._by_id.get(request_id)

    def find(self, key: str, caller: Identity) -> WaitRecord | None:
        """The caller's own record under `key`, proven by its kernel identity."""
        if not key:
            return None
        record = self._by_id.get(self._by_key.get((caller.uid, key), ""))
        if record is None or record.holder.process != caller.process or record.holder.uid != caller.uid:
            return None
        return record

    def granted(self, request_id: str, lease_id: str) -> None:
        """Its grant was made while nobody waited on the stream: keep it for the waiter."""
        record = self._by_id.get(request_id)
        if record is not None:
            self.add(replace(record, lease_id=lease_id))

    def drop(self, request_id: str) -> WaitRecord | None:
        record = self._by_id.pop(request_id, None)
        if record is not None and self._by_key.get((record.holder.uid, record.key)) == request_id:
            del self._by_key[(record.holder.uid, record.key)]
        if record is not None and record.lease_id and self._by_lease.get(record.lease_id) == request_id:
            del self._by_lease[record.lease_id]
        return record

    def drop_lease(self, lease_id: str) -> None:
        """A lease ended: a grant waiting for its waiter is gone with it."""
        request_id = self._by_lease.pop(lease_id, None)
        record = self._by_id.get(request_id) if request_id is not None else None
        if record is not None and record.lease_id == lease_id:  # (still the record that kept it)
            self.drop(record.request_id)
