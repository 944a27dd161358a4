"""The accounting file's one writer thread (brokerd/state/accounting.py): it owns the SQLite
connection; whatever is queued while it works goes into its next transaction, so a burst
of lease ends costs one commit.

It must outlive whatever it is given (issue 31): a caller that leaves early (a report whose
RPC hit its deadline, a dashboard page closed mid-request) cancels its future, and setting
the result of a cancelled future raises, which used to end this thread, and with it every
later report and every lease-end row until a restart. So a cancelled op is skipped before
it runs (Future.set_running_or_notify_cancel), one that has started can no longer be
cancelled, and any failure of a batch is logged to the journal, settles that batch's
futures, and leaves the thread serving the next one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from brokerd.base.journal import log_event

T = TypeVar("T")
Op = Callable[[sqlite3.Connection], Any]
_Item = tuple[Op, concurrent.futures.Future[Any], bool]

# A lease's end row may wait this long for company before it is committed: on a busy
# host one commit then carries many ends, and this thread leaves the cores to the lease
# path (a lost row is put back from the lease store at start: the accounting's backfill).
GATHER_S = 0.5


class AccountingWriter:
    """Rows submitted with `gather` wait up to GATHER_S for more; anything else (a report)
    goes at once."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._ops: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="vaccel-accounting", daemon=True)
        self._thread.start()

    def submit(self, op: Callable[[sqlite3.Connection], T], *, gather: bool = False) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._closed:
            future.set_exception(RuntimeError("accounting is closed"))
        else:
            self._ops.put((op, future, gather))
        return future

    def close(self, timeout_s: float = 10.0) -> None:
        if not self._closed:
            self._closed = True
            self._ops.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._ops.get()
            if item is None:
                break
            batch, stop = self._gather(item)
            try:
                self._commit(batch)
            except Exception as exc:  # never the end of the thread: the next batch is served
                log_event("accounting", f"a write to the accounting file failed ({type(exc).__name__}: {exc}); "
                          "the writer goes on", level=logging.ERROR)
                for _, future, _ in batch:
                    _settle(future, None, exc)
        self._conn.close()

    def _gather(self, first: _Item) -> tuple[list[_Item], bool]:
        """`first` and what else is queued (waiting up to GATHER_S when `first` may wait);
        True when the writer was told to stop meanwhile."""
        batch = [first]
        deadline = time.monotonic() + GATHER_S if first[2] else 0.0
        while True:
            try:
                wait = deadline - time.monotonic()
                more = self._ops.get(timeout=wait) if wait > 0 else self._ops.get_nowait()
            except queue.Empty:
                return batch, False
            if more is None:
                return batch, True
            batch.append(more)
            if not more[2]:
                deadline = 0.0  # someone waits for this one: commit now

    def _commit(self, batch: list[_Item]) -> None:
        # A caller that left has cancelled its future: its work is not done at all. The
        # others are running from here on, so nobody can cancel them any more.
        wanted = [(op, future) for op, future, _ in batch if future.set_running_or_notify_cancel()]
        if not wanted:
            return
        done: list[tuple[concurrent.futures.Future[Any], Any, BaseException | None]] = []
        try:
            self._conn.execute("BEGIN")
            for op, future in wanted:
                try:
                    done.append((future, op(self._conn), None))
                except Exception as exc:  # this op's statement is undone, the others stand
                    done.append((future, None, exc))
            self._conn.execute("COMMIT")
        except Exception as exc:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            done = [(future, None, exc) for _, future in wanted]
        for future, result, error in done:
            _settle(future, result, error)


def _settle(future: concurrent.futures.Future[Any], result: Any, error: BaseException | None) -> None:
    """Give the future its outcome unless it has one (cancelled before it ran, or settled)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
