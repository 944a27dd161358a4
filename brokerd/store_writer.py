"""LeaseStore's commits: where each write's transaction runs, and when its future resolves.

A write's future resolves only once its transaction has committed. Writes commit in the
order they were made, several in one transaction when they come together (group commit):

- on the loop itself, in its next turn (call_soon) together with every write made until
  then, when none needs an fsync and nothing is in flight on the writer thread. With
  synchronous=NORMAL a commit is a write into the WAL file (the page cache), ~0.1 ms, and
  doing it here saves the two thread hops a grant used to wait for: the writer thread had
  to win the interpreter lock from a busy loop (up to the 5 ms switch interval for each
  statement on a loaded host), and the loop to be woken again with the result.
- on the one writer thread otherwise: writes that must be fsync'd (every write under
  durability = "power"; reservations and drains always), and every write made while the
  thread still has work, so that the order of commits is always the order of the writes.
  The WAL checkpoints run there too, on a connection of their own (the loop's commits
  never checkpoint: that fsyncs), so they hold up neither the loop nor its commits.

A commit on the loop that takes longer than SLOW_COMMIT_S (a disk the kernel throttles,
say, while a student writes a 50 GB checkpoint) sends the commits back to the thread for
OFF_LOOP_AFTER_SLOW_S: only the grants wait for the disk then, not the heartbeats, queue
updates and Status that share the loop.

Only one of the two ever uses the connection at a time: the loop hands nothing to itself
while anything is in flight on the thread, and the thread has nothing while the loop
commits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable

log = logging.getLogger("vaccel.brokerd")

Op = Callable[[sqlite3.Connection], None]
CHECKPOINT_EVERY = 200  # commits between WAL checkpoints (each adds a few 4 KiB pages)


class StateError(Exception):
    """The state directory cannot be trusted (the daemon must not start on it), or the
    store is closed."""


class _Write:
    """One write; `fsync` when it must outlive a power loss."""

    __slots__ = ("fsync", "future", "op")

    def __init__(self, op: Op, future: asyncio.Future[None], fsync: bool) -> None:
        self.op, self.future, self.fsync = op, future, fsync


SLOW_COMMIT_S = 0.005  # a commit on the loop slower than this...
OFF_LOOP_AFTER_SLOW_S = 10.0  # ...keeps the commits on the thread this long
_CHECKPOINT: list[_Write] = []  # the item on the writer's queue that asks for a checkpoint


class Commits:
    """The commits of one connection; LeaseStore's saves hand their writes to `submit`."""

    def __init__(self, fsync_all: bool) -> None:
        self.fsync_all = fsync_all
        self.inline = True  # may commit on the loop (tests that park the writer turn it off)
        self.conn: sqlite3.Connection | None = None
        self._checkpointer: sqlite3.Connection | None = None  # the writer thread's, for checkpoints
        self.commits = 0  # transactions committed, for the benchmark's batching figure
        self._synced = True  # the connection's synchronous level is FULL (as opened)
        self._checkpointed_at = 0
        self._ops: queue.SimpleQueue[list[_Write] | None] = queue.SimpleQueue()
        self._held: list[_Write] | None = None  # writes held back for one transaction (hold())
        self._pending: list[_Write] = []  # writes of this loop step, to commit at its end
        self._in_flight = 0  # items handed to the writer thread and not yet settled
        self._off_loop_until = 0.0  # after a slow commit on the loop (time.monotonic)
        self.slow_commits = 0  # commits on the loop that took longer than SLOW_COMMIT_S
        self._thread: threading.Thread | None = None

    def start(self, conn: sqlite3.Connection, path: str) -> None:
        conn.execute("PRAGMA wal_autocheckpoint=0")  # the writer thread checkpoints
        self.conn = conn
        self._checkpointer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._checkpointer.execute("PRAGMA busy_timeout=5000")
        self._thread = threading.Thread(target=self._writer, name="vaccel-store", daemon=True)
        self._thread.start()

    # -- the loop's side ------------------------------------------------------------------

    def submit(self, op: Op, fsync: bool) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        write = _Write(op, future, fsync or self.fsync_all)
        if self._thread is None:  # closed (shutting down): say so rather than never answer
            future.set_exception(StateError("the lease database is closed"))
        elif self._held is not None:
            self._held.append(write)
        else:
            self._enqueue([write], loop)
        return future

    def hold(self) -> None:
        """Hold the writes submitted from now on until release_held(): they then commit in
        one transaction (one by one only if that fails)."""
        if self._held is None:
            self._held = []

    def release_held(self) -> None:
        held, self._held = self._held, None
        if held:
            self._enqueue(held, held[0].future.get_loop())

    def _enqueue(self, writes: list[_Write], loop: asyncio.AbstractEventLoop) -> None:
        if (self.inline and not self._in_flight and not any(w.fsync for w in writes)
                and time.monotonic() >= self._off_loop_until):
            if not self._pending or self._pending[0].future.get_loop() is not loop:
                loop.call_soon(self._flush)  # (a test's earlier loop may have ended unflushed)
            self._pending.extend(writes)
        else:  # behind what this step already wrote, if anything: the order is kept
            pending, self._pending = self._pending, []
            self._to_thread(pending + writes)

    def _to_thread(self, writes: list[_Write]) -> None:
        self._in_flight += 1
        self._ops.put(writes)

    def _flush(self) -> None:
        """The loop's next turn: commit here what was written since the last flush."""
        batch, self._pending = self._pending, []
        if not batch:
            return
        if self.conn is None:
            for write in batch:
                _settle(write.future, StateError("the lease database is closed"))
            return
        started = time.monotonic()
        errors = self._run_batch(batch)
        took = time.monotonic() - started
        if took > SLOW_COMMIT_S:
            self.slow_commits += 1
            self._off_loop_until = started + took + OFF_LOOP_AFTER_SLOW_S
            log.warning("a lease database commit took %.0f ms on the event loop; committing on the writer "
                        "thread for the next %.0f s", took * 1000, OFF_LOOP_AFTER_SLOW_S)
        for write, error in zip(batch, errors, strict=True):
            _settle(write.future, error)
        self._checkpoint_if_due()

    def _checkpoint_if_due(self) -> None:
        if self.commits - self._checkpointed_at >= CHECKPOINT_EVERY:
            self._checkpointed_at = self.commits
            self._ops.put(_CHECKPOINT)  # not in flight: it does not use the commits' connection

    # -- the writer thread's side ---------------------------------------------------------

    def _writer(self) -> None:
        try:
            self._drain_forever()
        except BaseException:
            # Without the writer nothing is ever made durable again and every grant or
            # release would hang: better to die loudly and let systemd restart us.
            log.critical("the lease database writer failed; exiting so the service restarts", exc_info=True)
            os._exit(70)

    def _drain_forever(self) -> None:
        while True:
            item = self._ops.get()
            if item is None:
                return
            if item is _CHECKPOINT:
                self._checkpoint()
                continue
            batch, items, last, checkpoint = list(item), 1, False, False
            while True:
                try:
                    more = self._ops.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    last = True
                    break
                if more is _CHECKPOINT:
                    checkpoint = True
                    continue
                batch.extend(more)
                items += 1
            self._settle_from_thread(batch, self._run_batch(batch), items)
            if checkpoint:
                self._checkpoint()
            if last:
                return

    def _checkpoint(self) -> None:
        """PASSIVE: copies what it can without waiting for, or blocking, the commits."""
        assert self._checkpointer is not None
        try:
            self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:  # the WAL only grows until the next one succeeds
            log.warning("lease database checkpoint failed: %s", exc)

    def _settle_from_thread(self, batch: list[_Write], errors: list[BaseException | None], items: int) -> None:
        def settle() -> None:
            self._in_flight -= items
            for write, error in zip(batch, errors, strict=True):
                _settle(write.future, error)
            self._checkpoint_if_due()

        loop = batch[0].future.get_loop()
        if not loop.is_closed():  # else nobody is left to hear of it (a test's loop ended first)
            loop.call_soon_threadsafe(settle)

    # -- either side (never both at once) -------------------------------------------------

    def _transaction(self, ops: list[Op], fsync: bool) -> None:
        conn = self.conn
        assert conn is not None
        if fsync != self._synced:  # a pragma, not a statement: set outside the transaction
            conn.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
            self._synced = fsync
        conn.execute("BEGIN IMMEDIATE")
        try:
            for op in ops:
                op(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # a failed COMMIT may already have rolled back
                conn.execute("ROLLBACK")
            raise
        self.commits += 1

    def _run_batch(self, batch: list[_Write]) -> list[BaseException | None]:
        """Commit the batch as one transaction; if that fails, one by one, so only the
        culprit fails. Each write's error, or None."""
        try:
            self._transaction([w.op for w in batch], any(w.fsync for w in batch))
        except Exception:
            pass
        else:
            return [None] * len(batch)
        errors: list[BaseException | None] = []
        for write in batch:
            try:
                self._transaction([write.op], write.fsync)
            except Exception as exc:
                log.error("lease database write failed: %s", exc)
                errors.append(exc)
            else:
                errors.append(None)
        return errors

    def close(self) -> None:
        """Commit what is held or pending (on the thread), stop the thread, close."""
        if self._thread is not None:
            # What this step wrote, then what it held: here, not through _enqueue, whose
            # loop may have ended already.
            writes = self._pending + (self._held or [])
            self._pending, self._held = [], None
            if writes:
                self._to_thread(writes)
            self._ops.put(None)
            self._thread.join(timeout=10)
            self._thread = None
        for conn in (self._checkpointer, self.conn):
            if conn is not None:
                conn.close()
        self._checkpointer = self.conn = None


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done() or future.get_loop().is_closed():  # its waiter gave up (or is gone)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
