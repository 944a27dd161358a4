"""What the broker refuses, as typed errors. Each carries the `kind` the servicer maps to a
gRPC status code, and a message that tells the user what to do.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from brokerd.contract import Evaluation


class LeaseError(Exception):
    """A request the broker refuses; `kind` maps to a gRPC status in the servicer."""

    kind = "failed_precondition"


class NotFound(LeaseError):
    kind = "not_found"


class PermissionDenied(LeaseError):
    """Raised only by brokerd/core/permissions.py, from its table of rules."""

    kind = "permission_denied"


class Unsatisfiable(LeaseError):
    """No set of devices on this host could ever satisfy the request."""

    kind = "failed_precondition"

    def __init__(self, message: str, evaluation: Evaluation | None = None) -> None:
        super().__init__(message)
        self.evaluation = evaluation


class Busy(LeaseError):
    """Satisfiable, but not now, and the caller would not wait."""

    kind = "resource_exhausted"


class Ended(LeaseError):
    """The lease exists but is over; the message says how it ended."""

    kind = "failed_precondition"


class Internal(LeaseError):
    """The broker could not do its part (for example, make a grant durable)."""

    kind = "internal"


class Unrecorded(Internal):
    """It could not be recorded for now: the state directory's disk is full. That passes,
    so the client asks again (gRPC UNAVAILABLE) rather than failing its job (issue 46)."""

    kind = "unavailable"


def not_recorded(message: str, cause: BaseException | str) -> Internal:
    """Internal, or Unrecorded when the cause is a full disk (ENOSPC; SQLite's "database
    or disk is full")."""
    full = (isinstance(cause, OSError) and cause.errno == errno.ENOSPC) or "disk is full" in str(cause)
    return (Unrecorded if full else Internal)(message)


class DeadlineExceeded(LeaseError):
    """The caller's wait ran out before a grant."""

    kind = "deadline_exceeded"
