"""The optional parts of the daemon, wired in one place: the lease hooks (brokerd/
lease_hooks.py) that follow every lease, and the extra servers (metrics, dashboard)
that start beside the gRPC socket. Each part reads its own config section; a part that
is off adds nothing."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from brokerd.addons.job_mapping import JobMapping
from brokerd.config.loader import Config
from brokerd.leasing.hooks import LeaseHook
from brokerd.state.accounting import Accounting

if TYPE_CHECKING:
    from brokerd.core.service import BrokerService

log = logging.getLogger("vaccel.brokerd")

Closer = Callable[[], Awaitable[None]]


def lease_hooks(config: Config, service: BrokerService) -> list[LeaseHook]:
    """The hooks, in the order they run at each moment (gating first: a grant it refuses
    must not reach the others)."""
    hooks: list[LeaseHook] = []
    if config.enforce_mode == "acl":
        from brokerd.addons.enforce.gate import DeviceGate  # the ACL binding is imported only when it is on

        hooks.append(DeviceGate(service))
    if config.slurm_mode == "delegate":  # after the gate: a grant it refuses still cancels the job
        from brokerd.addons.slurm.delegate import SlurmDelegate

        service.slurm = SlurmDelegate(config, service)
        hooks.append(service.slurm)
    hooks.extend(_usage_hooks(config, service))
    return hooks


def _usage_hooks(config: Config, service: BrokerService) -> list[LeaseHook]:
    """Accounting (always: `vaccel report` reads it), the metrics and dcgm-exporter's
    job mapping (each when configured)."""
    accounting = Accounting(config.state_dir, lambda: service.config, snapshot=lambda: service.snapshot,
                            recently_ended=lambda: list(service.manager.ended.values()))
    service.accounting = accounting  # the Report RPC and the dashboard
    hooks: list[LeaseHook] = [accounting]
    if config.metrics_listen:
        from brokerd.addons.metrics import MetricsHook  # prometheus-client is imported only when it is on

        hooks.append(MetricsHook(service))
    if config.metrics_job_mapping_dir is not None:
        hooks.append(JobMapping(config.metrics_job_mapping_dir,
                                lambda uuid: device.index if (device := service.device(uuid)) else None))
    return hooks


async def start_servers(config: Config, service: BrokerService) -> list[Closer]:
    """Start the extra servers the config turns on; return how to stop each."""
    closers: list[Closer] = []
    closers.extend(hook.close for hook in service.hooks if hook.name == "device gate")  # type: ignore[attr-defined]
    closers.extend(await _start_usage(config, service))
    if service.slurm is not None:
        await service.slurm.start()
        closers.append(service.slurm.close)
    if config.web_listen:
        from brokerd.addons.web.server import Dashboard  # aiohttp is imported only when the dashboard is on

        dashboard = Dashboard(service, config.web_listen)
        try:
            await dashboard.start()
        except OSError as exc:  # leases matter more than a page about them: serve on without
            log.error("dashboard: cannot serve on %s: %s", config.web_listen, exc)
        else:
            follow_changes(service, dashboard.changed)
            closers.append(dashboard.close)
    return closers


async def _start_usage(config: Config, service: BrokerService) -> list[Closer]:
    closers: list[Closer] = []
    for hook in service.hooks:
        if isinstance(hook, Accounting):
            hook.start()
            closers.append(hook.close)
        elif isinstance(hook, JobMapping):
            closers.append(hook.close)
        elif hook.name == "metrics":
            from brokerd.addons.metrics import MetricsHook, MetricsServer

            assert isinstance(hook, MetricsHook)
            server = MetricsServer(hook, config.metrics_listen)
            try:
                await server.start()
            except OSError as exc:  # leases matter more than their metrics: serve on without
                log.error("metrics: cannot serve on %s: %s", config.metrics_listen, exc)
            else:
                closers.append(server.close)
    return closers


def follow_changes(service: BrokerService, callback: Callable[[], None]) -> None:
    """Call `callback` too at every change the service announces (service.on_change),
    keeping what is there (the daemon sets its own, the systemd status line, first)."""
    previous = service.on_change

    def both() -> None:
        previous()
        try:
            callback()
        except Exception:  # an extra server must never break the path that changed
            log.exception("%s failed after a change", callback)

    service.on_change = both
