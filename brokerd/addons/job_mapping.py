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

The daemon writes there as root, so the folder is the daemon's own (issue 31): made by it
when missing, refused when anyone else could write or replace it or a folder on the way
(brokerd/base/trusted_dir.py), and every name is opened inside the folder's descriptor
without following links (O_NOFOLLOW, O_EXCL for the temporary file, fchmod on the file
itself, a rename within the folder). A file to read back (our lease id?) is read only if
it is a plain file, without waiting on it: a FIFO planted there stalls nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from brokerd.base.trusted_dir import UntrustedDir, open_trusted_dir
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.model import Lease

log = logging.getLogger("vaccel.brokerd")

LEASE_ID_PREFIX = "l-"  # what tells our files from others' in a shared folder
MAX_READ = 256  # a lease id is short: a file read back is read no further


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
            except UntrustedDir as exc:
                log.error("job mapping: refusing the folder %s (nothing is written there): %s", self.folder, exc)
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
        with _Folder(self.folder) as folder:
            folder.replace(str(index), lease_id + "\n")

    def _remove(self, index: int, lease_id: str) -> None:
        with _Folder(self.folder) as folder:
            if folder.read(str(index)) == lease_id:
                folder.unlink(str(index))

    def _reconcile(self, held: dict[int, str]) -> None:
        """After a start: the files of leases that ended while the daemon was down go,
        those of the leases restored are written. Files that are not ours stay."""
        with _Folder(self.folder) as folder:
            for name in folder.names():
                if name.isdigit() and int(name) not in held and folder.read(name).startswith(LEASE_ID_PREFIX):
                    folder.unlink(name)
            for index, lease_id in held.items():
                folder.replace(str(index), lease_id + "\n")


class _Folder:
    """The mapping folder, opened as trusted (brokerd/base/trusted_dir.py), made if missing;
    every name is relative to its descriptor and no link is followed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> _Folder:
        self.fd = open_trusted_dir(self.path, create_mode=0o755)  # the exporter may run as another user
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def names(self) -> list[str]:
        return [entry.name for entry in os.scandir(self.fd)]

    def read(self, name: str) -> str:
        """The first line of a plain file `name`, "" for anything else (a link, a FIFO, a
        folder, a missing or unreadable file)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return ""
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ""
            return f.read(MAX_READ).decode(errors="replace").strip()

    def replace(self, name: str, text: str) -> None:
        tmp = f".{name}.vaccel-tmp"  # a dotted name: the exporter skips it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=self.fd)  # a leftover (or a planted link: unlink removes the link itself)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=self.fd)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o644)  # the umask may have taken some away; the exporter may run as another user
            f.write(text.encode())
        os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)
