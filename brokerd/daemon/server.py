"""Assemble and run the daemon: state, inventory, gRPC on a Unix socket, the identity
side socket, timers, systemd notification and signals.

Start-up order matters: the state is restored and both sockets listen before READY=1.
Signal handlers only set events; the main coroutine does the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from brokerd.base.journal import log_event, setup_logging
from brokerd.config.loader import Config, ConfigError, load_config
from brokerd.core.service import BrokerService
from brokerd.daemon import addons, unit_needs
from brokerd.daemon.notify import Notifier, StatusLine
from brokerd.devices.model import Snapshot
from brokerd.devices.probes import default_probes, run_probes
from brokerd.devices.probes.simulated import SimulatedProbe
from brokerd.devices.watch import boot_snapshot
from brokerd.edge.identity import IdentityServer, TokenAuthority, load_or_create_key
from brokerd.edge.messages import rebuild_request
from brokerd.edge.rpc_limits import CONNECTION_OPTIONS, add_guarded_servicer, guarded_handlers, raise_open_files
from brokerd.edge.servicer import BrokerServicer
from brokerd.edge.side_calls import SideCalls
from brokerd.edge.standard_services import add_standard_services
from brokerd.state.state_dir import StateDirInUse, UnsafeStateDir, lock_state_dir
from brokerd.state.store import LeaseStore, StateError
from vaccel_common.paths import identity_socket

log = logging.getLogger("vaccel.brokerd")

MAX_MESSAGE_BYTES = 1 << 20
# Config fields a reload cannot apply, with the names the config file gives them.
RESTART_ONLY = {"socket": "server.socket", "state_dir": "server.state_dir", "inventory": "server.inventory",
                "socket_mode": "server.socket_mode", "socket_group": "server.socket_group",
                "token_ttl_s": "leases.token_ttl",
                # The gate is wired in at start-up and reconciles the nodes then (brokerd/addons/enforce/).
                "enforce_mode": "enforce.mode",
                # Their hook and server exist or not from the start (brokerd/daemon/addons.py).
                "metrics_listen": "metrics.listen", "metrics_job_mapping_dir": "metrics.hpc_job_mapping_dir",
                "web_listen": "web.listen",
                # The delegate (Slurm allocates) is wired in at start-up (brokerd/daemon/addons.py).
                "slurm_mode": "slurm.mode", "slurm_node": "slurm.node", "slurm_partition": "slurm.partition",
                "slurm_gres": "slurm.gres"}


class StartupError(Exception):
    """The daemon cannot start; the message says why and what to do."""


def inventory_source(config: Config) -> Callable[[], Snapshot]:
    """Real probing, or the simulated inventory when (and only when) one is configured."""
    if config.inventory is not None:
        probe = SimulatedProbe(config.inventory)
        return lambda: run_probes([probe], cpu_fallback=False)
    probes = default_probes()
    return lambda: run_probes(probes, cpu_fallback=config.offer_cpu)


def _lock_state_dir(state_dir: Path) -> int:
    try:
        return lock_state_dir(state_dir)  # ours alone, no symlinks: brokerd/state/state_dir.py
    except UnsafeStateDir as exc:
        raise StartupError(str(exc)) from None
    except StateDirInUse:
        raise StartupError(
            f"another vaccel-brokerd already uses the state directory {state_dir}; "
            "stop it first (systemctl stop vaccel-brokerd) or pass another --state-dir"
        ) from None


def _prepare_socket(path: Path) -> None:
    """Make the socket's folder reachable by every user and clear a stale socket. Refuse a
    folder someone else controls: they could swap our socket for an impostor's."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o755)
        os.chmod(path.parent, 0o755)  # mkdir's mode is masked by the umask
    st = path.parent.stat()
    sticky = bool(st.st_mode & 0o1000)
    if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not sticky):
        raise StartupError(
            f"refusing to serve from {path.parent}: it is owned by uid {st.st_uid} or writable by "
            "others, so someone else could replace the socket; use a folder you own (--socket)"
        )
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody listens: left over from a crash
        else:
            raise StartupError(f"another broker is already listening on {path}")
        finally:
            probe.close()


class Daemon:
    def __init__(self, config: Config, config_path: Path | None, overrides: dict[str, Any]) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides
        self.notifier = Notifier.from_env()
        self._stop = asyncio.Event()
        self._reload = asyncio.Event()

    async def run(self) -> int:
        config = self.config
        raise_open_files()
        lock_fd = _lock_state_dir(config.state_dir)
        # Everything that can refuse to start comes before the state is touched.
        _prepare_socket(config.socket)
        authority = TokenAuthority(load_or_create_key(config.state_dir), config.token_ttl_s)
        store = LeaseStore(config.state_dir, config.durability)
        try:
            active, ended, drained = store.open()
            queued = store.queued()
        except StateError as exc:
            store.close()
            raise StartupError(str(exc)) from exc
        loop = asyncio.get_running_loop()
        source = inventory_source(config)
        held = {uuid for lease in active for uuid in lease.devices}
        try:
            snapshot = await boot_snapshot(source, held, pause_s=min(config.probe_interval_s or 1.0, 1.0))
        except ValueError as exc:  # a bad simulated inventory file
            store.close()
            raise StartupError(str(exc)) from exc
        # A feature the unit blocks is refused here, named with its setting, before it could log
        # that it serves (brokerd/daemon/unit_needs.py).
        config = self.config = unit_needs.refuse_blocked(config)
        service = BrokerService(config, store, snapshot, refresh=source)
        added = addons.plug_in(config, service)
        service.restore(active, ended, drained)
        authority.alive = service.process_alive  # a watched process's pidfd answers, not /proc
        service.restore_queue(queued, rebuild_request)

        # Before anything listens: a client may signal us (a test's SIGHUP, systemd's SIGTERM)
        # the moment a socket answers, and SIGHUP's default action would end the daemon.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload.set)
        # Before the extra servers: the status line hears each change before the dashboard.
        self.status_line = StatusLine(self.notifier, service.summary)
        service.changes.subscribe(self.status_line.changed)
        # Before the sockets: once a client can connect, the metrics and the dashboard answer too.
        closers = await addons.start_servers(config, service, added)
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", 16 * MAX_MESSAGE_BYTES),
            *CONNECTION_OPTIONS,
        ])
        handlers = guarded_handlers(BrokerServicer(service, authority))  # undecodable: INVALID_ARGUMENT
        add_guarded_servicer(handlers, server)
        health = await add_standard_services(server)  # grpc.health.v1 and reflection: reads, no token
        server.add_insecure_port(f"unix:{config.socket}")
        await server.start()
        # The same handlers answer a short-lived client's unary calls on the identity socket.
        identity = IdentityServer(authority, Path(identity_socket(config.socket)), config.socket_mode,
                                  SideCalls(handlers))
        await identity.start()
        for path in (config.socket, identity.path):
            os.chmod(path, config.socket_mode)
            if config.socket_group:
                os.chown(path, -1, grp.getgrnam(config.socket_group).gr_gid)
        service.start_timers()

        watchdog = asyncio.create_task(self._watchdog())

        devices = len(snapshot.devices)
        log_event("start", f"serving {devices} {'simulated ' if snapshot.simulated else ''}device(s) "
                  f"on {config.socket}; {len(active)} lease(s) restored", socket=str(config.socket))
        self.notifier.ready()
        self.status_line.send()
        try:
            while not self._stop.is_set():
                stop = asyncio.create_task(self._stop.wait())
                reload = asyncio.create_task(self._reload.wait())
                await asyncio.wait({stop, reload}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                reload.cancel()
                if self._reload.is_set():
                    self._reload.clear()
                    self._apply_reload(service)
        finally:
            self.notifier.stopping()
            log_event("stop", "shutting down; leases stay recorded and resume on restart")
            watchdog.cancel()
            for close in closers:
                await close()
            await identity.close()
            service.shutting_down()  # streams cut by the shutdown keep their queue places
            await health.enter_graceful_shutdown()
            await server.stop(grace=1.0)
            await service.close()
            store.close()
            with contextlib.suppress(FileNotFoundError):
                config.socket.unlink()
            os.close(lock_fd)
        return 0

    def _apply_reload(self, service: BrokerService) -> None:
        self.notifier.reloading()
        try:
            new = load_config(self.config_path, self.overrides)
        except ConfigError as exc:
            log_event("reload", f"configuration rejected, keeping the old one: {exc}", level=logging.ERROR)
        else:
            # Read once at start-up (the sockets, the token authority, the state): these
            # keep their running values until a restart, and every reload says so.
            immovable = [k for k in RESTART_ONLY if getattr(new, k) != getattr(self.config, k)]
            # A feature newly turned on that the running unit blocks is refused now, in one line
            # naming the setting; the rest of the restart-only changes are listed below.
            allowed = unit_needs.refuse_blocked(new, moment="reload", only={RESTART_ONLY[k] for k in immovable})
            refused = {k for k in immovable if getattr(allowed, k) != getattr(new, k)}
            new = dataclasses.replace(new, **{k: getattr(self.config, k) for k in immovable})
            immovable = [k for k in immovable if k not in refused]
            self.config = new
            service.reconfigure(new)
            setup_logging(new.log_level)
            if immovable:
                log_event("reload", f"configuration partly reloaded from {new.source}: "
                          f"{', '.join(RESTART_ONLY[k] for k in immovable)} need a restart to take effect "
                          "(systemctl restart vaccel-brokerd); every other setting was applied",
                          level=logging.WARNING)
            else:
                log_event("reload", f"configuration reloaded from {new.source}")
        self.notifier.ready()
        self.status_line.send()

    async def _watchdog(self) -> None:
        """Ping from the event loop itself: a hung loop stops the pings and systemd restarts us."""
        interval = self.notifier.watchdog_interval_s()
        if interval is None:
            return
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)
