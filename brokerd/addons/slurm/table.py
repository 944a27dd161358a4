"""Which Slurm job stands behind which vaccel lease, on disk: its own small SQLite file in
the state directory (slurm-jobs.sqlite), apart from the lease store, so the store's schema
does not change for a mode most hosts never use.

A row is written as soon as Slurm names the job, before the job is granted and long
before the lease is committed: after a crash, a row whose lease is not live is a job to
cancel, and no job vaccel made can be forgotten while it runs. Commits are synchronous
and run on a thread (asyncio.to_thread), never on the event loop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

FILE_NAME = "slurm-jobs.sqlite"


class JobTable:
    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS slurm_jobs (lease_id TEXT PRIMARY KEY, job_id INTEGER NOT NULL)")

    def load(self) -> dict[str, int]:
        """lease id -> job id, read at start-up (before the loop serves anyone)."""
        with self._lock:
            return {lease: job for lease, job in self._db.execute("SELECT lease_id, job_id FROM slurm_jobs")}

    def _write(self, sql: str, args: tuple[object, ...]) -> None:
        with self._lock:
            self._db.execute(sql, args)

    async def add(self, lease_id: str, job_id: int) -> None:
        await asyncio.to_thread(self._write, "INSERT OR REPLACE INTO slurm_jobs VALUES (?, ?)", (lease_id, job_id))

    async def remove(self, lease_id: str) -> None:
        await asyncio.to_thread(self._write, "DELETE FROM slurm_jobs WHERE lease_id = ?", (lease_id,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
