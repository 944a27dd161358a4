"""The Prometheus endpoint (`[metrics] listen`, off by default): devices by state, leases,
the queue, waits, grants and ends, device-hours by user, and per device its utilisation,
memory and lease holder, labelled as dcgm-exporter labels its series (gpu, UUID,
pci_bus_id, modelName, Hostname) so that a site's GPU dashboards can join them.

The HTTP side runs on its own threads (the standard library's threaded WSGI server with
prometheus-client's app), never on the event loop: a slow or hostile client holds one
of at most MAX_CLIENTS threads for at most REQUEST_TIMEOUT_S. A scrape reads the broker's
state by asking the event loop for a copy (a few microseconds there), so no thread ever
reads the lease manager while the loop changes it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from brokerd.core.service import BrokerService
from brokerd.core.views import device_views
from brokerd.devices.model import UTILISATION_KEY, Device
from brokerd.leasing.hooks import LeaseHook
from brokerd.leasing.model import ENDED_STATES, Lease

log = logging.getLogger("vaccel.brokerd")

MAX_CLIENTS = 8  # scrapes served at once; more connections are closed at once
REQUEST_TIMEOUT_S = 10.0  # a client silent this long mid-request is dropped
SCRAPE_TIMEOUT_S = 5.0  # how long a scrape waits for the event loop's copy of the state
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
    """What one scrape shows, copied on the event loop."""

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
        self._loop: asyncio.AbstractEventLoop | None = None
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

    # -- scrapes (on an HTTP thread) -------------------------------------------------------

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def describe(self) -> list[Metric]:
        # Nothing to declare up front; without this, registering would collect (and wait
        # for the event loop that is registering).
        return []

    async def _read(self) -> _State:
        manager = self.service.manager
        now = time.time()
        hours = dict(self._ended_hours)
        for lease in manager.leases.values():
            user = _user(lease)
            hours[user] = hours.get(user, 0.0) + _hours(lease, now, self._started_at)
        devices = tuple(_DeviceState(v.device, v.state, v.lease.id if v.lease else "",
                                     _user(v.lease) if v.lease else "",
                                     tuple((s.lease.id, _user(s.lease), s.lease.share_mib) for s in v.shares))
                        for v in device_views(manager))
        return _State(devices, len(manager.leases), len(manager.queue), hours)

    def collect(self) -> Iterator[Metric]:
        if self._loop is None:
            return
        state = asyncio.run_coroutine_threadsafe(self._read(), self._loop).result(SCRAPE_TIMEOUT_S)
        yield from self._families(state)

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
        hours = CounterMetricFamily("vaccel_device_hours", "Device-hours leased since the daemon started, by user",
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


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # StreamRequestHandler sets it on the connection

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every 15 s is not news; errors reach the daemon's log through the app


class _BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, at most MAX_CLIENTS of them."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(*args, **kwargs)

    def server_bind(self) -> None:
        # HTTPServer's own looks the address up in DNS (getfqdn), on the event loop at
        # start-up: a broken resolver must not delay the daemon. The name is unused here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.setup_environ()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class MetricsServer:
    """/metrics over HTTP on `address` ("host:port"), on its own threads."""

    def __init__(self, hook: MetricsHook, address: str) -> None:
        self.hook = hook
        self.address = address
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        host, port = _split(self.address)
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("_MetricsServer", (_BoundedServer,), {"address_family": family})
        self.hook.bind(asyncio.get_running_loop())
        self._server = make_server(host, port, make_wsgi_app(self.hook.registry), server_class, _Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="vaccel-metrics", daemon=True)
        self._thread.start()
        if not _is_loopback(host):
            log.warning("metrics served on %s: anyone who can reach it reads who holds which device", self.address)
        log.info("metrics served on http://%s/metrics", self.address)

    async def close(self) -> None:
        if self._server is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._server.shutdown)
            self._server.server_close()
