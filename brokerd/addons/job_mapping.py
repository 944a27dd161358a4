"""Lease ids where dcgm-exporter's `--hpc-job-mapping-dir` reads job ids
(`[metrics] hpc_job_mapping_dir`, off by default), so a site's existing GPU series gain
an `hpc_job` label naming the lease; `vaccel_device_lease_info` (brokerd/addons/metrics.py)
carries the same lease id with its user, for a join.

The exporter reads every file in the folder whose name is a device index and takes each
line as a job id. So: one file per leased device, named by its index on this host,
holding its lease id on one line; removed when the lease ends. Files are replaced
atomically (written under a dotted name the exporter skips, then renamed), and written
on one worker thread in order, never on the event loop (the folder may be on any
filesystem).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.model import Lease

log = logging.getLogger("vaccel.brokerd")

LEASE_ID_PREFIX = "l-"  # what tells our files from others' in a shared folder


class JobMapping(LeaseHook):
    name = "job-mapping"

    def __init__(self, folder: Path, index_of: Callable[[str], int | None]) -> None:
        self.folder = folder
        self._index_of = index_of  # device uuid -> its index now, None when it is gone
        self._written: dict[str, tuple[int, ...]] = {}  # lease id -> the files it has
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaccel-jobmap")

    def _submit(self, work: Callable[[], None], what: str) -> None:
        def logged() -> None:
            try:
                work()
            except OSError as exc:
                log.warning("job mapping: could not %s in %s: %s", what, self.folder, exc)

        try:
            self._worker.submit(logged)
        except RuntimeError:  # shut down: the daemon is stopping, the next start reconciles
            pass

    def restored(self, active: Iterable[Lease]) -> None:
        held: dict[int, str] = {}
        for lease in active:
            self._written[lease.id] = self._indexes(lease)
            held.update(dict.fromkeys(self._written[lease.id], lease.id))
        self._submit(lambda: self._reconcile(held), "reconcile the files")

    def granted(self, lease: Lease) -> None:
        indexes = self._written[lease.id] = self._indexes(lease)
        for index in indexes:
            self._submit(lambda index=index: self._write(index, lease.id), f"write gpu{index}'s file")

    def ended(self, lease: Lease) -> None:
        for index in self._written.pop(lease.id, ()):
            self._submit(lambda index=index: self._remove(index, lease.id), f"remove gpu{index}'s file")

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._worker.shutdown)

    def _indexes(self, lease: Lease) -> tuple[int, ...]:
        return tuple(i for i in map(self._index_of, lease.devices) if i is not None)

    # -- on the worker thread --------------------------------------------------------------

    def _write(self, index: int, lease_id: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o755)
        tmp = self.folder / f".{index}.vaccel-tmp"
        tmp.write_text(lease_id + "\n")
        os.chmod(tmp, 0o644)  # the exporter may run as another user
        os.replace(tmp, self.folder / str(index))

    def _remove(self, index: int, lease_id: str) -> None:
        path = self.folder / str(index)
        with contextlib.suppress(FileNotFoundError):
            if path.read_text().strip() == lease_id:
                path.unlink()

    def _reconcile(self, held: dict[int, str]) -> None:
        """After a start: the files of leases that ended while the daemon was down go,
        those of the leases restored are written. Files that are not ours stay."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o755)
        for path in self.folder.iterdir():
            if not path.name.isdigit() or int(path.name) in held or not path.is_file():
                continue
            with contextlib.suppress(OSError, UnicodeDecodeError):
                if path.read_text().strip().startswith(LEASE_ID_PREFIX):
                    path.unlink()
        for index, lease_id in held.items():
            self._write(index, lease_id)
