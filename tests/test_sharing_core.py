"""The daemon's side of sharing (issue 35), in plain Python: `[sharing]` in the config,
which devices its names mark shared (MIG instances by their GPU's name too), and the
budget check a probe refresh runs: warn a share over its budget, call the end off when it
is back within it, leave the others alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from brokerd.config.loader import Config, ConfigError, load_config
from brokerd.contract import Requirement
from brokerd.core.budgets import ShareBudgets
from brokerd.core.sharing import SharedDevices
from brokerd.devices.model import Device, GpuProcess, Snapshot
from brokerd.devices.occupancy import Occupancy
from brokerd.leasing.manager import LeaseManager
from brokerd.leasing.model import OVER_BUDGET, Ask, Lease
from tests.test_leases import ALICE, BOB, gpu


def instance(gpu_index: int, n: int) -> Device:
    return Device(index=gpu_index, uuid=f"MIG-{gpu_index}-{n}", vendor="nvidia", name="card MIG 1g.10gb",
                  memory_mib=9856, backend="cuda", mig_index=n, parent_uuid=f"GPU-{gpu_index}", mig_profile="1g.10gb")


def test_the_sharing_section_is_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "brokerd.toml"
    path.write_text('[sharing]\ndevices = ["gpu3", "GPU-1"]\nover_budget_grace = "45s"\n')
    config = load_config(path)
    assert (config.sharing_devices, config.sharing_over_budget_grace_s) == (("gpu3", "GPU-1"), 45.0)
    assert (Config().sharing_devices, Config().sharing_over_budget_grace_s) == ((), 30.0)
    path.write_text('[sharing]\ndevices = "gpu3"\n')
    with pytest.raises(ConfigError, match=r"sharing.devices: write a list of device names"):
        load_config(path)


def test_names_mark_devices_by_index_uuid_gpu_or_all(caplog: pytest.LogCaptureFixture) -> None:
    devices = [gpu(0), gpu(1), instance(2, 0), instance(2, 1)]
    shared = SharedDevices()
    assert shared.resolve(["gpu1"], devices) == {"GPU-1"}
    assert shared.resolve(["GPU-0", "gpu2.1"], devices) == {"GPU-0", "MIG-2-1"}
    assert shared.resolve(["gpu2"], devices) == {"MIG-2-0", "MIG-2-1"}  # a GPU in MIG mode: each instance
    assert shared.resolve(["GPU-2"], devices) == {"MIG-2-0", "MIG-2-1"}
    assert shared.resolve(["all"], devices) == {d.uuid for d in devices}
    with caplog.at_level(logging.WARNING, logger="vaccel.brokerd"):
        for _ in range(3):
            assert shared.resolve(["gpu7"], devices) == frozenset()
    told = [r for r in caplog.records if "'gpu7', which is no device here" in r.getMessage()]
    assert len(told) == 1, "an unknown name is said once, not at every probe"


class Probe:
    """The last probe as the budget check reads it: processes and their matched leases."""

    def __init__(self) -> None:
        self.processes: list[GpuProcess] = []
        self.matched: dict[int, str] = {}

    def uses(self, pid: int, lease: Lease, mib: int) -> None:
        self.processes.append(GpuProcess(pid=pid, device_uuid=lease.devices[0], used_memory_mib=mib))
        self.matched[pid] = lease.id


def test_a_share_over_budget_is_warned_and_called_off_when_back_within() -> None:
    manager = LeaseManager([gpu(0)])
    manager.set_sharing(["GPU-0"])
    alice = manager.submit(ALICE, Requirement(1), wait=False, ask=Ask(memory_mib=20480))
    bob = manager.submit(BOB, Requirement(1), wait=False, ask=Ask(memory_mib=30720))
    probe, told = Probe(), []
    budgets = ShareBudgets(manager, config=lambda: Config(sharing_over_budget_grace_s=30.0),
                           snapshot=lambda: Snapshot((gpu(0),), tuple(probe.processes)),
                           occupancy=lambda: Occupancy(matched=probe.matched),
                           note_ending=lambda lease, what: told.append((lease.id, what)))
    probe.uses(101, alice, 10240)
    probe.uses(102, bob, 20480)
    probe.uses(103, bob, 16384)  # bob's two processes: 36 GiB of a 30 GiB share
    budgets.check()
    assert [lease_id for lease_id, _ in told] == [bob.id]
    assert bob.ending_state == OVER_BUDGET and "uses 36 GiB of device memory, over its share of 30 GiB" in bob.notice
    assert bob.expires_at and not alice.notice
    budgets.check()
    assert len(told) == 1, "warned once, not at every probe"
    probe.processes.pop()  # back to 20 GiB
    budgets.check()
    assert told[-1] == (bob.id, "back within its share: its end is called off")
    assert (bob.notice, bob.ending_state) == ("", "")
    assert budgets.used() == {alice.id: 10240, bob.id: 20480}


def test_a_share_whose_end_has_come_is_not_called_off_when_its_processes_are_gone(monkeypatch) -> None:
    """At its end the client stops the share's command; a probe that then finds its
    processes gone (before the broker's own timer ended the lease, on a loaded machine)
    must not read that as "back within its share": the end stands, as over_budget."""
    import brokerd.core.budgets as budgets_module

    manager = LeaseManager([gpu(0)])
    manager.set_sharing(["GPU-0"])
    bob = manager.submit(BOB, Requirement(1), wait=False, ask=Ask(memory_mib=30720))
    probe, told, now = Probe(), [], [1000.0]
    monkeypatch.setattr(budgets_module.time, "time", lambda: now[0])
    budgets = ShareBudgets(manager, config=lambda: Config(sharing_over_budget_grace_s=30.0),
                           snapshot=lambda: Snapshot((gpu(0),), tuple(probe.processes)),
                           occupancy=lambda: Occupancy(matched=probe.matched),
                           note_ending=lambda lease, what: told.append((lease.id, what)))
    probe.uses(102, bob, 36864)
    budgets.check()
    assert bob.ending_state == OVER_BUDGET and bob.expires_at == 1030.0
    now[0] = 1030.2  # its end has come: the client stopped the command
    probe.processes.clear()
    budgets.check()
    assert bob.ending_state == OVER_BUDGET and len(told) == 1, told
