"""What the lease manager keeps: a lease, a waiting request, a grant, and the states a
lease ends in. Plain data; the rules that move it live in brokerd/leasing/manager.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from brokerd.base.process import Holder, ProcessId
from brokerd.contract import CheckLine, Evaluation, Requirement

ACTIVE = "active"
RELEASED = "released"
EXPIRED = "expired"
REVOKED = "revoked"
HOLDER_EXITED = "holder_exited"
LOST = "lost"  # its device vanished or turned unhealthy, or could not be opened for its holder
IDLE = "idle"  # reclaimed: its devices showed no use while others waited
TIME_LIMIT = "time_limit"  # reached the time limit it was granted with
OVER_BUDGET = "over_budget"  # a memory share that used more than its share for longer than the grace
ENDED_STATES = (RELEASED, EXPIRED, REVOKED, HOLDER_EXITED, LOST, IDLE, TIME_LIMIT, OVER_BUDGET)


@dataclass(frozen=True)
class LeaseTerms:
    """What a grant carries besides devices, decided by the daemon's config."""

    allocator_config: str = ""
    memory_cap_mib: int = 0
    accelerator_config_yaml: str = ""


@dataclass(frozen=True)
class ContainerHold:
    """The container a lease is applied to (`vaccel run -- docker run ...`), as its engine
    (rootful) or the kernel (rootless) confirmed it: the lease ends when `init` exits, and
    its end stops the container (brokerd/addons/containers/). `held`: the container holds
    the lease alone (`docker run -d`): `init` is then its holder, and no heartbeat is due."""

    engine: str  # "docker" | "podman" | "podman-rootless"
    id: str  # the engine's full id
    name: str
    image: str
    init: ProcessId  # the container's init, as a host process
    held: bool = False
    warn_signal: int = 0  # sent before a time limit or a revoke with grace to those that catch it; 0 none


@dataclass
class Lease:
    id: str
    holder: Holder
    devices: tuple[str, ...]
    backend: str
    granted_at: float
    expires_at: float = 0.0  # hard end from the maximum duration; 0 = none
    terms: LeaseTerms = field(default_factory=LeaseTerms)
    warnings: tuple[CheckLine, ...] = ()
    simulated: bool = False
    state: str = ACTIVE
    end_reason: str = ""
    ended_at: float = 0.0
    last_heartbeat: float = 0.0
    members: set[ProcessId] = field(default_factory=set)  # processes that joined it
    requested_at: float = 0.0  # when its request was made: the wait is granted_at - this
    reservation: bool = False  # held by the user (`vaccel reserve`), not by the asking process
    notice: str = ""  # why it ends early at expires_at (an admin's revoke with grace, idle reclaim)
    time_limit_s: float = 0.0  # the time limit it was granted with, 0 = none
    ending_state: str = ""  # the state it ends in at expires_at when `notice` says it ends early
    # The client's key for the request it was granted on: the same process asking again
    # under it (the reply was lost) gets this lease back (brokerd/core/acquiring.py).
    request_key: str = ""
    container: ContainerHold | None = None  # the container it is applied to
    # A memory share (brokerd/leasing/shares.py): it holds share_mib of its one device, a
    # device of memory share_of_mib when granted, beside other shares. 0: it holds its
    # devices whole.
    share_mib: int = 0
    share_of_mib: int = 0
    # Lent while idle ([policy] lend_idle, brokerd/leasing/lending.py): granted over its
    # user's limits on devices no request within limits could use; it ends with notice
    # when such a request needs them.
    borrowed: bool = False

    @property
    def active(self) -> bool:
        return self.state == ACTIVE

    @property
    def beats(self) -> bool:
        """Whether a heartbeat keeps it: not a reservation (its user holds it) nor a lease a
        container holds (its init's exit ends it)."""
        return not self.reservation and not (self.container is not None and self.container.held)

    @property
    def weight(self) -> float:
        """How many devices it counts as, for fair share, limits and accounting: a share
        counts as its part of the device's memory."""
        if self.share_mib and self.share_of_mib:
            return self.share_mib / self.share_of_mib
        return float(len(self.devices))


@dataclass(frozen=True)
class Ask:
    """What a request asks for besides its contract: how long, which devices, and whether
    it is a reservation (held by the user rather than by the asking process)."""

    time_limit_s: float = 0.0  # 0 = none (the manager's maximum duration applies)
    only: tuple[str, ...] = ()  # device uuids it may have; empty = any
    reservation: bool = False
    memory_mib: int = 0  # > 0: a share of this much memory of one shared device, not whole devices


@dataclass(frozen=True)
class UserLimits:
    """The policy that applies to one user (brokerd/config/policy.py resolves it). 0 = no limit."""

    policy: str = "default"  # "default" or "group students": named in every refusal
    max_devices: int = 0
    max_waiting: int = 0
    max_device_hours: float = 0.0
    window_s: float = 7 * 86400.0
    max_leases: int = 0  # leases and shares held at once: a share weighs little, but each is a status line
    min_share_mib: int = 0  # the smallest memory share granted


@dataclass
class Request:
    id: str
    holder: Holder
    requirement: Requirement
    evaluation: Evaluation
    terms: LeaseTerms
    since: float
    ask: Ask = field(default_factory=Ask)
    limits: UserLimits = field(default_factory=UserLimits)
    reason: str = ""  # why it waits, as the last pump saw it ("" = its turn has not come)


@dataclass(frozen=True)
class Grant:
    request: Request
    lease: Lease


def heartbeat_interval(ttl_s: float) -> float:
    """Beat often enough that two lost beats still fit in the TTL, and at least every 5 s
    so a revoked holder hears of it promptly."""
    return max(0.2, min(ttl_s / 4, 5.0))
