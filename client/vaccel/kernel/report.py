"""What the kernel process tells the Jupyter server's provisioner: each new queue message,
then the grant or the refusal, and later, if it comes, the lease's end behind the kernel's
back (so that Jupyter's automatic restart does not lease again). One JSON object a line on
a pipe whose write end the provisioner passes down (its number in VACCEL_KERNEL_REPORT_FD)
and the kernel keeps for its whole life.

A pipe rather than the kernel's stderr: stderr is the server's own (its log), shared by
every kernel, and a refusal must reach the provisioner as the reason its start failed.
Without the variable (the kernel started by something else) the kernel reports on stderr.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

REPORT_FD_VAR = "VACCEL_KERNEL_REPORT_FD"

QUEUED, GRANTED, REFUSED, LOST = "queued", "granted", "refused", "lost"


@dataclass(frozen=True)
class Report:
    kind: str  # queued | granted | refused | lost
    message: str

    def line(self) -> bytes:
        return (json.dumps({"kind": self.kind, "message": self.message}) + "\n").encode()

    @classmethod
    def parse(cls, line: bytes) -> Report | None:
        """The report on one line; None for anything else (a partial line, junk)."""
        try:
            data = json.loads(line)
            return cls(str(data["kind"]), str(data["message"]))
        except (ValueError, KeyError, TypeError):
            return None


class Reporter:
    """The kernel's side: writes to the provisioner's pipe, or to stderr without one.
    Repeated queue messages (the broker sends one per update) are written once."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        self._last = ""
        if fd is not None:
            os.set_inheritable(fd, False)  # nothing the notebook starts should hold it open

    @classmethod
    def from_env(cls) -> Reporter:
        value = os.environ.pop(REPORT_FD_VAR, "")
        return cls(int(value) if value.isdigit() else None)

    def queued(self, message: str) -> None:
        if message != self._last:
            self._last = message
            self._send(Report(QUEUED, message))

    def granted(self, message: str) -> None:
        self._send(Report(GRANTED, message))

    def refused(self, message: str) -> None:
        self._send(Report(REFUSED, message))
        self.close()

    def lost(self, message: str) -> None:
        """The lease ended behind the kernel's back; the kernel is about to stop."""
        self._send(Report(LOST, message))

    def _send(self, report: Report) -> None:
        if self._fd is None:
            print(f"vaccel: {report.message}", file=sys.stderr, flush=True)
            return
        try:
            os.write(self._fd, report.line())
        except OSError:  # the server went away: the kernel goes on, it reports to nobody
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
