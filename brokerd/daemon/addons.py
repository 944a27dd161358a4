"""Which optional parts the config turns on, built and plugged into the core in one place:
the lease hooks (device-node gating, Slurm, accounting, the containers leases are applied
to, metrics, dcgm-exporter's job mapping), the outside allocator (Slurm in delegate mode),
and the extra servers (metrics, dashboard) that start beside the gRPC socket. A part that is
off adds nothing."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from brokerd.addons.containers.keeper import ContainerKeeper
from brokerd.addons.job_mapping import JobMapping
from brokerd.config.loader import Config
from brokerd.core.service import BrokerService
from brokerd.state.accounting import Accounting

log = logging.getLogger("vaccel.brokerd")

Closer = Callable[[], Awaitable[None]]


@dataclass
class AddOns:
    """What was plugged in, to start and stop with the daemon (None: off)."""

    accounting: Accounting
    containers: ContainerKeeper
    gate: Any = None  # brokerd.addons.enforce.gate.DeviceGate
    delegate: Any = None  # brokerd.addons.slurm.delegate.SlurmDelegate
    metrics: Any = None  # brokerd.addons.metrics.MetricsHook
    mapping: JobMapping | None = None


def plug_in(config: Config, service: BrokerService) -> AddOns:
    """Build the parts the config turns on and plug them into `service`, in the order their
    hooks run at each moment (gating first: a grant it refuses must not reach the others)."""
    gate = delegate = metrics = mapping = None
    if config.enforce_mode == "acl":
        from brokerd.addons.enforce.gate import DeviceGate  # the ACL binding is imported only when it is on

        gate = DeviceGate(service)
        service.add_hook(gate)
    if config.slurm_mode == "delegate":  # after the gate: a grant it refuses still cancels the job
        from brokerd.addons.slurm.delegate import SlurmDelegate

        delegate = SlurmDelegate(config, service)
        service.add_hook(delegate)
        service.use_allocator(delegate)
    # Accounting always: `vaccel report` reads it.
    accounting = Accounting(config.state_dir, lambda: service.config, snapshot=lambda: service.snapshot,
                            recently_ended=lambda: list(service.manager.ended.values()))
    service.add_hook(accounting)
    service.use_reporter(accounting)
    if config.metrics_listen:
        from brokerd.addons.metrics import MetricsHook  # prometheus-client is imported only when it is on

        metrics = MetricsHook(service)
        service.add_hook(metrics)
    # Always: a rootless container needs no engine configured, the kernel answers for it.
    containers = ContainerKeeper(service)
    service.add_hook(containers)
    service.use_containers(containers)
    service.changes.subscribe(containers.changed)
    if config.metrics_job_mapping_dir is not None:
        mapping = JobMapping(config.metrics_job_mapping_dir,
                             lambda uuid: device.index if (device := service.device(uuid)) else None)
        service.add_hook(mapping)
    return AddOns(accounting, containers, gate, delegate, metrics, mapping)


async def start_servers(config: Config, service: BrokerService, added: AddOns) -> list[Closer]:
    """Start what the plugged-in parts run beside the gRPC socket; return how to stop each."""
    added.containers.start()  # after the restore: what runs outside a live lease is judged against it
    closers: list[Closer] = [added.containers.close]
    if added.gate is not None:
        closers.append(added.gate.close)
    added.accounting.start()
    closers.append(added.accounting.close)
    if added.mapping is not None:
        closers.append(added.mapping.close)
    if added.metrics is not None:
        from brokerd.addons.metrics import MetricsServer

        server = MetricsServer(added.metrics, config.metrics_listen)
        try:
            await server.start()
        except OSError as exc:  # leases matter more than their metrics: serve on without
            log.error("metrics: cannot serve on %s: %s", config.metrics_listen, exc)
        else:
            closers.append(server.close)
    if added.delegate is not None:
        await added.delegate.start()
        closers.append(added.delegate.close)
    if config.web_listen:
        from brokerd.addons.web.server import Dashboard  # aiohttp is imported only when the dashboard is on

        dashboard = Dashboard(service, config.web_listen, added.accounting)
        try:
            await dashboard.start()
        except OSError as exc:  # leases matter more than a page about them: serve on without
            log.error("dashboard: cannot serve on %s: %s", config.web_listen, exc)
        else:
            service.changes.subscribe(dashboard.changed)
            closers.append(dashboard.close)
    return closers
