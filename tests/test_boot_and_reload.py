"""Start-up believes a probe under the same rule as every refresh (a probe that misses
devices the restored leases hold is believed only once that persists), and a reload that
cannot apply a setting says which ones need a restart instead of "configuration reloaded"."""

from __future__ import annotations

import asyncio
import signal
import time

from brokerd.devices.model import Device, Snapshot
from brokerd.devices.watch import PROBE_FAILURES_BEFORE_BELIEVED, boot_snapshot
from tests.conftest import DEFAULT_CONFIG

GPU = Device(0, "GPU-0", "nvidia", "card", 1024, "cuda", "sm_80", simulated=True)


def probes(*snapshots: Snapshot):
    """A refresh that returns `snapshots` in turn (the last one from then on)."""
    calls = []

    def refresh() -> Snapshot:
        calls.append(1)
        return snapshots[min(len(calls), len(snapshots)) - 1]

    return refresh, calls


def test_a_probe_that_misses_held_devices_once_at_boot_is_not_believed():
    refresh, calls = probes(Snapshot(()), Snapshot((GPU,)))
    snapshot = asyncio.run(boot_snapshot(refresh, {"GPU-0"}, pause_s=0))
    assert snapshot.devices == (GPU,), "the restored lease's device is kept"
    assert len(calls) == 2


def test_a_boot_probe_that_keeps_missing_devices_is_believed_as_a_refresh_would_be():
    refresh, calls = probes(Snapshot(()))
    assert asyncio.run(boot_snapshot(refresh, {"GPU-0"}, pause_s=0)).devices == ()
    assert len(calls) == PROBE_FAILURES_BEFORE_BELIEVED


def test_nothing_held_means_the_first_probe_is_taken():
    refresh, calls = probes(Snapshot(()), Snapshot((GPU,)))
    assert asyncio.run(boot_snapshot(refresh, set(), pause_s=0)).devices == ()
    assert len(calls) == 1


def test_a_reload_names_the_settings_that_need_a_restart(start_broker):
    broker = start_broker(config=DEFAULT_CONFIG)
    broker.config.write_text(DEFAULT_CONFIG.replace("[leases]\n", '[leases]\ntoken_ttl = "20m"\n')
                             + '[server]\nsocket_mode = "0660"\n')
    broker.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while "need a restart" not in broker.log.read_text():
        assert time.monotonic() < deadline and broker.proc.poll() is None, broker.log.read_text()
        time.sleep(0.05)
    log = broker.log.read_text()
    line = next(ln for ln in log.splitlines() if "need a restart" in ln)
    assert "leases.token_ttl" in line and "server.socket_mode" in line, line
    assert "heartbeat_ttl" not in line and "configuration reloaded from" not in log
    # Nothing changed behind the message: the socket keeps its mode until a restart.
    assert broker.socket.stat().st_mode & 0o777 == 0o666
