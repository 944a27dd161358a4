"""The Prometheus endpoint (`[metrics] listen`, off by default): devices by state, leases,
the queue, waits, grants and ends, device-hours, and per device its utilisation, memory
and lease holder, labelled as dcgm-exporter labels its series (gpu, UUID, pci_bus_id,
modelName, Hostname) so that a site's GPU dashboards can join them.

The HTTP side is aiohttp on the daemon's own loop (brokerd/addons/http_guard.py): a slow
or trickling client is only a coroutine, its request must arrive whole within
REQUEST_TIMEOUT_S, and each client (a local user, as the kernel knows them, or a remote
address) holds at most PER_CLIENT connections, so one user's slow connections never
keep Prometheus from its scrape (issue 31: eight trickling connections used to hold every
thread of the old threaded server). A scrape reads the broker's state in place, on the
loop, in well under a millisecond for a host's devices.

Anyone on the host can read the endpoint (it has no login), so it shows what `vaccel
status` shows everyone, the current holders, and device-hours per user only where the lab
makes usage public (`[accounting] per_user_report = "everyone"`); otherwise one series
without a user label carries everyone's hours together.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from brokerd.addons.http_guard import ConnectionBudget, serve, split_listen
from brokerd.core.service import BrokerService
from brokerd.core.views import device_views
from brokerd.devices.model import UTILISATION_KEY, Device
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.model import ENDED_STATES, Lease

log = logging.getLogger("vaccel.brokerd")

MAX_CONNECTIONS = 64
PER_CLIENT = 8  # Prometheus keeps one connection per target; a few more for people with curl
REQUEST_TIMEOUT_S = 10.0  # a request not whole this long after the connection (or the last reply) is dropped
DEVICE_STATES = ("free", "leased", "shared", "drained", "busy", "unhealthy", "missing")
DEVICE_LABELS = ("gpu", "UUID", "pci_bus_id", "modelName", "Hostname")  # dcgm-exporter's names
WAIT_BUCKETS_S = (1, 10, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 7 * 86400)


def device_labels(device: Device, hostname: str) -> list[str]:
    """The label values, in DEVICE_LABELS order, that dcgm-exporter gives the same device
    (its `gpu` is the device's index on this host)."""
    return [str(device.index), device.uuid, device.pci_bus_id, device.name, hostname]


@dataclass(frozen=True)
class _DeviceState:
    device: Device
    state: str
    lease_id: str
    user: str
    shares: tuple[tuple[str, str, int], ...] = ()  # (lease id, user, MiB) of each memory share on it


@dataclass(frozen=True)
class _State:
    """What one scrape shows."""

    devices: tuple[_DeviceState, ...]
    leases_active: int
    queue_length: int
    device_hours: dict[str, float]


class MetricsHook(LeaseHook):
    """Counts grants, ends, waits and device-hours as leases come and go (on the event
    loop), and collects the rest from the service at each scrape."""

    name = "metrics"

    def __init__(self, service: BrokerService, hostname: str | None = None) -> None:
        self.service = service
        self.hostname = hostname or socket.gethostname()
        self.registry = CollectorRegistry(auto_describe=False)
        self._grants = Counter("vaccel_lease_grants", "Leases granted, by kind", ["kind"], registry=self.registry)
        self._ends = Counter("vaccel_lease_ends", "Leases ended, by end state", ["reason"], registry=self.registry)
        self._wait = Histogram("vaccel_lease_wait_seconds", "Time a granted request waited in the queue",
                               buckets=WAIT_BUCKETS_S, registry=self.registry)
        for kind in ("lease", "reservation"):
            self._grants.labels(kind)
        for state in ENDED_STATES:
            self._ends.labels(state)
        # Counted from the daemon's start, as a Prometheus counter restarts with its process:
        # a lease restored after a restart adds only its hours since then.
        self._started_at = time.time()
        self._ended_hours: dict[str, float] = {}
        self.registry.register(self)

    # -- the lease's moments (never raise: a raising granted() would refuse the grant) --

    def granted(self, lease: Lease) -> None:
        try:
            self._grants.labels("reservation" if lease.reservation else "lease").inc()
            if lease.requested_at:
                self._wait.observe(max(0.0, lease.granted_at - lease.requested_at))
        except Exception:
            log.exception("metrics: counting the grant of %s failed", lease.id)

    def ended(self, lease: Lease) -> None:
        self._ends.labels(lease.state).inc()
        hours = _hours(lease, lease.ended_at, self._started_at)
        if hours > 0:
            user = _user(lease)
            self._ended_hours[user] = self._ended_hours.get(user, 0.0) + hours

    # -- scrapes (on the event loop) -------------------------------------------------------

    def describe(self) -> list[Metric]:
        # Nothing to declare up front; without this, registering would collect at once.
        return []

    def _read(self) -> _State:
        manager = self.service.manager
        now = time.time()
        hours = dict(self._ended_hours)
        for lease in manager.leases.values():
            user = _user(lease)
            hours[user] = hours.get(user, 0.0) + _hours(lease, now, self._started_at)
        if self.service.config.accounting_per_user_report != "everyone":
            hours = {"": sum(hours.values())}  # other users' history: everyone's together, no user label
        devices = tuple(_DeviceState(v.device, v.state, v.lease.id if v.lease else "",
                                     _user(v.lease) if v.lease else "",
                                     tuple((s.lease.id, _user(s.lease), s.lease.share_mib) for s in v.shares))
                        for v in device_views(manager))
        return _State(devices, len(manager.leases), len(manager.queue), hours)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._read())

    def _families(self, state: _State) -> Iterator[Metric]:
        by_state = GaugeMetricFamily("vaccel_devices", "Devices by state", labels=["state"])
        counts = {s: 0 for s in DEVICE_STATES}
        for d in state.devices:
            counts[d.state] = counts.get(d.state, 0) + 1
        for name, count in counts.items():
            by_state.add_metric([name], count)
        yield by_state
        yield GaugeMetricFamily("vaccel_leases_active", "Leases holding devices now", value=state.leases_active)
        yield GaugeMetricFamily("vaccel_queue_length", "Requests waiting for devices", value=state.queue_length)
        hours = CounterMetricFamily("vaccel_device_hours", "Device-hours leased since the daemon started, by user "
                                    "where usage is public (accounting.per_user_report), else all together",
                                    labels=["user"])
        for user, value in sorted(state.device_hours.items()):
            hours.add_metric([user], value)
        yield hours
        yield from self._device_families(state.devices)

    def _device_families(self, devices: Sequence[_DeviceState]) -> Iterator[Metric]:
        labels = list(DEVICE_LABELS)
        device_state = GaugeMetricFamily("vaccel_device_state", "1 for the state each device is in",
                                         labels=[*labels, "state"])
        lease = GaugeMetricFamily(
            "vaccel_device_lease_info", "1 per leased device, naming its lease and holder (hpc_job is the "
            "lease id, as dcgm-exporter's job mapping labels the device's series)",
            labels=[*labels, "lease_id", "hpc_job", "user"])
        util = GaugeMetricFamily("vaccel_device_utilization_percent", "Device utilisation at the last probe",
                                 labels=labels)
        used = GaugeMetricFamily("vaccel_device_memory_used_bytes", "Device memory in use at the last probe",
                                 labels=labels)
        total = GaugeMetricFamily("vaccel_device_memory_total_bytes", "Device memory", labels=labels)
        share = GaugeMetricFamily("vaccel_device_share_bytes", "Each memory share of a shared device, naming its "
                                  "lease and holder", labels=[*labels, "lease_id", "hpc_job", "user"])
        for d in devices:
            values = device_labels(d.device, self.hostname)
            device_state.add_metric([*values, d.state], 1)
            if d.lease_id:
                lease.add_metric([*values, d.lease_id, d.lease_id, d.user], 1)
            for lease_id, user, mib in d.shares:
                share.add_metric([*values, lease_id, lease_id, user], mib * 1024 * 1024)
            reading = d.device.extra.get(UTILISATION_KEY)
            if isinstance(reading, int | float) and not isinstance(reading, bool):
                util.add_metric(values, float(reading))
            used.add_metric(values, d.device.memory_used_mib * 1024 * 1024)
            total.add_metric(values, d.device.memory_mib * 1024 * 1024)
        yield from (device_state, lease, util, used, total, share)


def _user(lease: Lease) -> str:
    return lease.holder.user or str(lease.holder.uid)


def _hours(lease: Lease, until: float, started_at: float) -> float:
    return lease.weight * max(0.0, until - max(lease.granted_at, started_at)) / 3600


# -- the HTTP server -----------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class MetricsServer:
    """/metrics over HTTP on `address` ("host:port"), on the daemon's loop; any path answers."""

    def __init__(self, hook: MetricsHook, address: str) -> None:
        self.hook = hook
        self.address = address
        self.budget = ConnectionBudget("metrics", per_client=PER_CLIENT, total=MAX_CONNECTIONS)
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None

    async def _scrape(self, request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self.hook.registry), headers={"Content-Type": content_type})

    async def start(self) -> None:
        host, port = split_listen(self.address)
        app = web.Application(client_max_size=1024)
        app.router.add_get("/{path:.*}", self._scrape)
        self._runner, self._server = await serve(app, host, port, self.budget, request_timeout_s=REQUEST_TIMEOUT_S)
        if not _is_loopback(host):
            log.warning("metrics served on %s: anyone who can reach it reads who holds which device", self.address)
        log.info("metrics served on http://%s/metrics", self.address)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._server is not None:
            await self._server.wait_closed()
