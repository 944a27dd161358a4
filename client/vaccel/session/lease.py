"""What the client knows about a lease it holds or joined: the `Lease` object that
`vaccel.lease()` yields and `vaccel run` supervises, its devices, and the two errors.

Kept apart from the session (session.py) so the object a user handles can be read
without the machinery that keeps it alive.
"""

from __future__ import annotations

import math
import os

from vaccel_common.backends import granted_env
from vaccel_common.record import record

# The quick `vaccel run -- docker run ...` imports this module (its LeaseError), so it imports
# neither typing (TYPE_CHECKING's value is False) nor protobuf, and units (re) only when it says an ending.
TYPE_CHECKING = False
if TYPE_CHECKING:  # only annotations here
    from typing import Any

    from vaccel_common.v1 import broker_pb2 as pb


class LeaseError(RuntimeError):
    """The broker refused or could not grant the lease; the message says why and what to do."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class LeaseLost(RuntimeError):
    """The lease ended while the process was still using it; stop using its devices."""


def ended_reason(lease_id: str, details: str) -> str:
    """The broker's word that a lease is over, said once: "lease l-1 has ended: revoked
    (revoked by root: maintenance)" becomes "revoked by root: maintenance" (the caller names
    the lease; the reason says the state); anything else is kept as it is."""
    if not details.startswith(f"lease {lease_id} has ended: "):
        return details
    text = details.removeprefix(f"lease {lease_id} has ended: ")
    state, _, reason = text.partition(" (")  # "time_limit (reached its time limit of 2h)"
    return reason[:-1] if state.replace("_", "").isalpha() and reason.endswith(")") else text


@record
class DeviceInfo:
    """One leased device as the broker described it at the grant."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    vendor: str
    arch: str
    simulated: bool
    visible_id: str
    device_nodes: tuple[str, ...] = ()  # the device's own nodes (a render node...): a container gets them
    label: str = ""  # how `vaccel status` names it: gpu0, or gpu0.1 for a MIG instance

    @classmethod
    def from_pb(cls, d: pb.Device) -> DeviceInfo:
        return cls(d.index, d.uuid, d.name, d.memory_mib, d.vendor, d.arch, d.simulated,
                   d.visible_id or d.uuid, tuple(d.device_nodes), d.label or f"gpu{d.index}")


@record
class LeaseEnding:
    """A lease will end soon: its time limit is near, or an admin revoked it with a grace.
    Passed to `on_ending` callbacks (and shown on stderr) so a job can checkpoint."""

    lease_id: str
    ends_at: float  # unix time
    seconds_left: float
    reason: str  # "time limit of 2h00m" or the admin's notice

    def __str__(self) -> str:
        from vaccel_common.units import format_duration

        left = math.ceil(max(0.0, self.seconds_left))  # "1s" when a little under a second is left
        return f"lease {self.lease_id} ends in {format_duration(left)}: {self.reason}"


class Lease:
    """A granted (or joined) lease. Attributes: id, backend, devices, env, accelerator,
    expires_at (0 = no limit), time_limit_s, reservation, notice."""

    def __init__(self, msg: pb.Lease, *, joined: bool) -> None:
        self.id: str = msg.id
        self.backend: str = msg.backend
        self.devices: list[DeviceInfo] = [DeviceInfo.from_pb(d) for d in msg.devices]
        self.memory_cap_mib: int = msg.memory_cap_mib
        self.share_mib: int = msg.share_mib  # a memory share of its one device, 0 = whole devices
        self.borrowed: bool = msg.borrowed  # lent while idle ([policy] lend_idle): ends with notice when needed
        self.simulated: bool = msg.simulated
        self.joined = joined
        self.warnings = [f"{w.name}: {w.message}" for w in msg.warnings]
        self.heartbeat_interval_s: float = msg.heartbeat_interval_s or 5.0
        self.expires_at: float = msg.expires_at
        self.time_limit_s: float = msg.time_limit_s
        self.reservation: bool = msg.reservation
        self.notice: str = msg.notice
        self.env: dict[str, str] = granted_env(msg)
        self._lost_reason = ""
        self._released = False
        self._accelerator: Any = None

    @property
    def ended(self) -> bool:
        """True once the lease was lost or released."""
        return bool(self._lost_reason) or self._released

    @property
    def end_reason(self) -> str:
        """Why it ended ("released", or the broker's reason); "" while it holds."""
        return self._lost_reason or ("released" if self._released else "")

    @property
    def lost_reason(self) -> str:
        """Why the broker ended the lease behind our back; "" while it holds (or after release)."""
        return self._lost_reason

    def forked_view(self) -> Lease:
        """This lease as seen from a forked child: joined, never released by the child."""
        view = object.__new__(Lease)
        view.__dict__.update(self.__dict__)
        view.joined = True
        view._accelerator = None
        return view

    def mark_lost(self, reason: str) -> None:
        """Record that the broker ended the lease; every later check() raises LeaseLost."""
        self._lost_reason = reason

    def mark_released(self) -> None:
        """Record that this process gave the lease back; every later check() raises LeaseLost."""
        self._released = True

    def check(self) -> None:
        """Raise LeaseLost when the lease is over: call it before touching the devices."""
        if self._lost_reason:
            raise LeaseLost(f"lease {self.id} ended: {self._lost_reason}; its devices may now "
                            "belong to someone else, stop using them")
        if self._released:
            raise LeaseLost(f"lease {self.id} was released")

    @property
    def accelerator(self) -> Any:
        """The vendor-agnostic torch accelerator for this lease (imports torch)."""
        self.check()
        if self._accelerator is None:
            from vaccel.accelerator import Accelerator

            self._accelerator = Accelerator(env={**os.environ, **self.env}, guard=self.check)
        return self._accelerator

    def close_accelerator(self) -> str:
        """Shut the accelerator down (its process group) if one was made; "" or why it failed."""
        if self._accelerator is None:
            return ""
        try:
            self._accelerator.close()
        except Exception as err:  # reported by the caller, who releases anyway
            return str(err)
        return ""

    def __repr__(self) -> str:
        names = ", ".join(d.name for d in self.devices)
        return f"<Lease {self.id} {self.backend} [{names}]{' joined' if self.joined else ''}>"
