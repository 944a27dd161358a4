"""A test's hand on LeaseStore's writer thread, without timing.

`WriterGate` stands in for the store's SQLite connection (the writer reads it at every
transaction): it counts committed transactions and can hold the writer at the start of
its next one, so a test knows exactly which saves are still queued behind it and will
form the next batch. A gated store commits on its writer thread only: a commit on the
event loop (store_writer) would park the loop itself at the gate.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from typing import Any

from brokerd.state.store import LeaseStore


class WriterGate:
    def __init__(self, store: LeaseStore) -> None:
        conn = store._conn
        assert isinstance(conn, sqlite3.Connection), "open the store before gating it"
        self._conn = conn
        store._conn = self  # type: ignore[assignment]
        store._commits.inline = False
        self.transactions = 0  # committed ones, counted at the COMMIT itself
        self._open = threading.Event()
        self._open.set()
        self._held = threading.Event()

    def hold(self) -> None:
        """Hold the writer at the BEGIN of its next transaction until `release()`."""
        self._held.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def wait_held(self) -> None:
        """Return once the writer is parked at that BEGIN (a deadline only guards a hang)."""
        held = await asyncio.to_thread(self._held.wait, 30)
        assert held, "the writer never started the transaction it was to be held at"

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.startswith("BEGIN") and not self._open.is_set():
            self._held.set()
            self._open.wait()
        cursor = self._conn.execute(sql, *args)
        if sql == "COMMIT":
            self.transactions += 1
        return cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)
