"""LeaseStore's commits: where each write's transaction runs, and when its future resolves.

A write's future resolves only once its transaction has committed; a write made with
`submit_then` has its callback called instead, as it settles and before any future of its
transaction resolves, so what it starts (the pump's grant reaching its waiter) goes ahead
of everything those futures wake. Writes commit in the order they were made, several in
one transaction when they come together (group commit):

- on the loop itself, in its next turn (call_soon) together with every write made until
  then, when none needs an fsync and nothing is in flight on the writer thread. With
  synchronous=NORMAL a commit is a write into the WAL file (the page cache), ~0.1 ms, and
  doing it here saves the two thread hops a grant used to wait for: the writer thread had
  to win the interpreter lock from a busy loop (up to the 5 ms switch interval for each
  statement on a loaded host), and the loop to be woken again with the result.
- on the one writer thread otherwise: writes that must be fsync'd (every write under
  durability = "power"; reservations and drains always), and every write made while the
  thread still has work, so that the order of commits is always the order of the writes.
  The WAL checkpoints run there too, every CHECKPOINT_EVERY commits (the loop's commits
  never checkpoint: that fsyncs), on a connection of their own, so commits go on
  meanwhile and no grant waits for a checkpoint's fsync. The WAL starts again from the
  top at the first commit after a checkpoint that copied all of it back, which on a
  host with any pause between grants is the next one. Under load that never pauses it
  would not (the WAL grew by ~20 KiB a commit): once a checkpoint finds the WAL longer
  than WAL_RESTART_FRAMES, the next one is two. The first copies back and fsyncs the bulk
  while the commits go on; the second is in flight like a write, copies only the frames
  made meanwhile, and the first commit after it restarts the WAL. (One in flight for the
  whole WAL made every 200th commit wait for its fsync: 15-20 ms.)

A commit on the loop that waited for the disk longer than SLOW_COMMIT_S (the kernel
throttles our writes, say, while a student writes a 50 GB checkpoint to the same disk)
sends the commits back to the thread for OFF_LOOP_AFTER_SLOW_S: only the grants wait for
the disk then, not the heartbeats, queue updates and Status that share the loop. "Waited"
means the thread slept (a voluntary context switch): a loop that was merely preempted on
a busy host is not a slow disk, and counting it kept a loaded broker's commits off the
loop for good (4 preemptions in a 40 s benchmark).

Only one of the two ever uses the connection at a time: the loop hands nothing to itself
while anything is in flight on the thread, and the thread has nothing while the loop
commits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import resource
import sqlite3
import threading
import time
from collections.abc import Callable

log = logging.getLogger("vaccel.brokerd")

Op = Callable[[sqlite3.Connection], None]
Then = Callable[[BaseException | None], None]  # told a write's outcome: None once committed, else the error
CHECKPOINT_EVERY = 200  # commits between WAL checkpoints (each adds a few 4 KiB pages)


class StateError(Exception):
    """The state directory cannot be trusted (the daemon must not start on it), or the
    store is closed."""


class _Write:
    """One write; `fsync` when it must outlive a power loss. Its outcome goes to `future`,
    or to `then` (submit_then)."""

    __slots__ = ("fsync", "future", "op", "then")

    def __init__(self, op: Op, fsync: bool, future: asyncio.Future[None] | None = None,
                 then: Then | None = None) -> None:
        self.op, self.fsync, self.future, self.then = op, fsync, future, then


SLOW_COMMIT_S = 0.05  # a commit on the loop that slept and took longer than this...
OFF_LOOP_AFTER_SLOW_S = 10.0  # ...keeps the commits on the thread this long
# A WAL longer than this (pages; SQLite's own checkpoint size, 4 MiB) gets a checkpoint commits wait for.
WAL_RESTART_FRAMES = 1000
_CHECKPOINT = "checkpoint"  # the items on the writer's queue that ask for one: alongside the commits...
_CHECKPOINT_AND_RESTART = "checkpoint, commits waiting"  # ...or with the commits behind it...
_CHECKPOINT_THEN_RESTART = "checkpoint, then one with the commits waiting"  # ...after one alongside them


class Commits:
    """The commits of one connection; LeaseStore's saves hand their writes to `submit`."""

    def __init__(self, fsync_all: bool) -> None:
        self.fsync_all = fsync_all
        self.inline = True  # may commit on the loop (tests that park the writer turn it off)
        self.conn: sqlite3.Connection | None = None
        self.commits = 0  # transactions committed, for the benchmark's batching figure
        self._synced = True  # the connection's synchronous level is FULL (as opened)
        self._checkpointed_at = 0
        self._ops: queue.SimpleQueue[list[_Write] | str | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the writes come from
        self._checkpointer: sqlite3.Connection | None = None  # the writer thread's, for checkpoints
        self._wal_too_long = False  # the last checkpoint found the WAL past WAL_RESTART_FRAMES
        self._checkpointing: str | None = None  # the checkpoint queued or running, if any (the loop's side)
        self._held: list[_Write] | None = None  # writes held back for one transaction (hold())
        self._pending: list[_Write] = []  # writes to commit on the loop at its next turn
        self._pending_loop: asyncio.AbstractEventLoop | None = None  # the loop whose turn commits them
        self._in_flight = 0  # items handed to the writer thread and not yet settled
        self._off_loop_until = 0.0  # after a slow commit on the loop (time.monotonic)
        self.slow_commits = 0  # commits on the loop that waited for the disk past SLOW_COMMIT_S
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
        """Queue a write; the future resolves once it is committed."""
        future: asyncio.Future[None] = self._bind_loop().create_future()
        self._add(_Write(op, fsync or self.fsync_all, future=future))
        return future

    def submit_then(self, op: Op, fsync: bool, then: Then) -> None:
        """Queue a write; `then` is called on the loop as it settles, before the futures
        of its transaction resolve (it must not raise)."""
        self._bind_loop()
        self._add(_Write(op, fsync or self.fsync_all, then=then))

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a first write, or a test's next loop: a checkpoint's end
            self._loop, self._checkpointing = loop, None  # told to a loop that had ended never came
        return loop

    def _add(self, write: _Write) -> None:
        if self._thread is None:  # closed (shutting down): say so rather than never answer
            closed = StateError("the lease database is closed")
            if write.future is not None:
                write.future.set_exception(closed)
            if write.then is not None:  # not from inside the caller's own step
                asyncio.get_running_loop().call_soon(_settle_batch, [write], [closed])
        elif self._held is not None:
            self._held.append(write)
        else:
            self._enqueue([write])

    def hold(self) -> None:
        """Hold the writes submitted from now on until release_held(): they then commit in
        one transaction (one by one only if that fails)."""
        if self._held is None:
            self._held = []

    def release_held(self) -> None:
        held, self._held = self._held, None
        if held:
            self._enqueue(held)

    def _enqueue(self, writes: list[_Write]) -> None:
        loop = self._loop
        assert loop is not None, "written to before any submit()"
        if (self.inline and not self._in_flight and not any(w.fsync for w in writes)
                and time.monotonic() >= self._off_loop_until):
            if not self._pending or self._pending_loop is not loop:
                loop.call_soon(self._flush)  # (a test's earlier loop may have ended unflushed)
                self._pending_loop = loop
            self._pending.extend(writes)
        else:
            self._to_thread(writes)

    def _to_thread(self, item: list[_Write] | str) -> None:
        """Hand an item to the writer thread, behind what the loop has still to commit:
        that goes first, and to the thread too, since the connection is the thread's now."""
        if self._pending:
            pending, self._pending = self._pending, []
            self._in_flight += 1
            self._ops.put(pending)
        self._in_flight += 1
        self._ops.put(item)

    def _flush(self) -> None:
        """The loop's next turn: commit here what was written since the last flush."""
        batch, self._pending = self._pending, []
        if not batch:  # close() took them, or an fsync'd write took them to the thread
            return
        started, slept_before = time.monotonic(), _sleeps()
        errors = self._run_batch(batch)
        took = time.monotonic() - started
        if took > SLOW_COMMIT_S and _sleeps() > slept_before:
            self.slow_commits += 1
            self._off_loop_until = started + took + OFF_LOOP_AFTER_SLOW_S
            log.warning("a lease database commit took %.0f ms on the event loop; committing on the writer "
                        "thread for the next %.0f s", took * 1000, OFF_LOOP_AFTER_SLOW_S)
        _settle_batch(batch, errors)
        self._checkpoint_if_due()

    def _checkpoint_if_due(self) -> None:
        if self.commits - self._checkpointed_at < CHECKPOINT_EVERY:
            return
        if self._checkpointing is None:  # one at a time: under load they would queue up
            self._checkpointed_at = self.commits
            # Neither is in flight: they have their own connection.
            self._checkpointing = _CHECKPOINT_THEN_RESTART if self._wal_too_long else _CHECKPOINT
            self._ops.put(self._checkpointing)
        elif self._checkpointing is _CHECKPOINT_THEN_RESTART:
            # Its first half is still copying after another CHECKPOINT_EVERY commits (a
            # loaded disk): the commits wait for the second from now, so the WAL restarts
            # within a bounded number of commits, however slow the first half.
            self._checkpointed_at = self.commits
            self._restart_wal()

    def _checkpointed(self, item: str) -> None:
        """On the loop, after a checkpoint: the one with the commits behind it, when the
        bulk is back (the first commit after it starts the WAL again from the top)."""
        if item is not _CHECKPOINT_THEN_RESTART:
            self._checkpointing = None
        elif self._checkpointing is _CHECKPOINT_THEN_RESTART:  # not asked for already
            self._restart_wal()

    def _restart_wal(self) -> None:
        self._checkpointing = _CHECKPOINT_AND_RESTART
        self._to_thread(_CHECKPOINT_AND_RESTART)

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
            items = [self._ops.get()]
            while items[-1] is not None:
                try:
                    items.append(self._ops.get_nowait())
                except queue.Empty:
                    break
            # In order: the writes between two checkpoints (or the end) make one batch.
            batch: list[_Write] = []
            count = 0
            for item in items:
                if isinstance(item, list):
                    batch.extend(item)
                    count += 1
                    continue
                if count:
                    self._settle_from_thread(batch, self._run_batch(batch), count)
                    batch, count = [], 0
                if item is None:
                    return
                if item is _CHECKPOINT_AND_RESTART:
                    self._checkpoint(self.conn)
                    self._settle_from_thread([], [], 1)
                else:
                    self._checkpoint(self._checkpointer)
                self._on_loop(self._checkpointed, item)
            if count:
                self._settle_from_thread(batch, self._run_batch(batch), count)

    def _checkpoint(self, conn: sqlite3.Connection | None) -> None:
        """PASSIVE: copies back what it can without waiting for, or blocking, a commit."""
        assert conn is not None
        try:
            _busy, frames, _copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:  # the WAL only grows until the next one succeeds
            log.warning("lease database checkpoint failed: %s", exc)
            return
        # After one the commits waited for, the next commit restarts the WAL, whatever
        # its length now.
        self._wal_too_long = conn is not self.conn and frames > WAL_RESTART_FRAMES

    def _settle_from_thread(self, batch: list[_Write], errors: list[BaseException | None], items: int) -> None:
        def settle() -> None:
            self._in_flight -= items
            _settle_batch(batch, errors)
            self._checkpoint_if_due()

        self._on_loop(settle)

    def _on_loop(self, callback: Callable[..., None], *args: object) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():  # else nobody is left to hear of it
            loop.call_soon_threadsafe(callback, *args)

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
        disk: BaseException | None = None  # the file's own failure (a full disk: SQLITE_FULL)
        for write in batch:
            try:
                self._transaction([write.op], write.fsync)
            except Exception as exc:
                log.error("lease database write failed: %s", exc)
                disk = disk or (exc if isinstance(exc, sqlite3.OperationalError) else None)
                # A grant that fails on what a failed end left (its holding: UNIQUE) failed for the disk.
                errors.append(disk if disk is not None and isinstance(exc, sqlite3.IntegrityError) else exc)
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


def _sleeps() -> int:
    """How often this thread has slept (voluntary context switches): ~1 us."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def _settle_batch(batch: list[_Write], errors: list[BaseException | None]) -> None:
    """Tell each write of a batch its outcome: the callbacks first, then the futures."""
    for write, error in zip(batch, errors, strict=True):
        if write.then is not None:
            try:
                write.then(error)
            except Exception:  # one callback's bug must not leave the rest of the batch unsettled
                log.exception("a commit's callback failed")
    for write, error in zip(batch, errors, strict=True):
        if write.future is not None:
            _settle(write.future, error)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done() or future.get_loop().is_closed():  # its waiter gave up (or is gone)
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
