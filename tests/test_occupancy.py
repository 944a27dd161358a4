"""brokerd.devices.occupancy: who uses which GPU, covered by which lease, and what is busy."""

from __future__ import annotations

from brokerd.base.procinfo import ProcInfo
from brokerd.devices.model import Device, GpuProcess
from brokerd.devices.occupancy import Occupancy, classify, to_signal

GPU0, GPU1, GPU2 = "GPU-0", "GPU-1", "GPU-2"

# pid -> parent; 100 is alice's `vaccel run`, 101 its torchrun, 102/103 the ranks.
PARENTS = {100: 1, 101: 100, 102: 101, 103: 101, 12345: 500, 500: 1, 600: 1}
INFO = {
    102: ProcInfo(102, 1001, "alice", "python3 train.py", 101, 1),
    12345: ProcInfo(12345, 1002, "bob", "python3 notebook.py", 500, 2),
    600: ProcInfo(600, 1001, "alice", "python3 other.py", 1, 3),
}


def ancestry(pid: int) -> list[int]:
    chain = []
    while pid in PARENTS and PARENTS[pid] > 0:
        pid = PARENTS[pid]
        chain.append(pid)
    return chain


def device(uuid: str, used: int = 0) -> Device:
    return Device(index=0, uuid=uuid, vendor="nvidia", name="H100", memory_mib=81559,
                  backend="cuda", memory_used_mib=used)


DEVICES = [device(GPU0), device(GPU1), device(GPU2)]
LEASES = {"L1": {100}}
LEASE_DEVICES = {"L1": {GPU0}}


def run(processes: list[GpuProcess], devices: list[Device] = DEVICES, **kw) -> Occupancy:
    return classify(processes, LEASES, LEASE_DEVICES, devices,
                    ancestry=ancestry, info=INFO.get, **kw)


def test_children_of_the_lease_holder_match_the_lease() -> None:
    occ = run([GpuProcess(102, GPU0, 1024), GpuProcess(103, GPU0, 1024)])
    assert occ.matched == {102: "L1", 103: "L1"}
    assert occ.unleased == ()
    assert occ.busy == {}


def test_foreign_process_makes_the_device_busy_with_a_readable_reason() -> None:
    occ = run([GpuProcess(12345, GPU1, 1024)])
    assert occ.busy == {GPU1: "IN USE WITHOUT LEASE by bob: pid 12345 python3, 1024 MiB"}
    (proc,) = occ.unleased
    assert (proc.uid, proc.user, proc.command) == (1002, "bob", "python3 notebook.py")
    assert occ.matched == {}


def test_lease_member_on_a_device_outside_its_lease_is_unleased_there() -> None:
    occ = run([GpuProcess(102, GPU0, 1024), GpuProcess(102, GPU2, 512)])
    assert occ.matched == {102: "L1"}
    assert [(p.pid, p.device_uuid) for p in occ.unleased] == [(102, GPU2)]
    assert occ.busy[GPU2].startswith("IN USE WITHOUT LEASE by alice: pid 102 python3, 512 MiB")
    assert "member of lease L1" in occ.busy[GPU2]
    assert GPU0 not in occ.busy


def test_several_offenders_on_one_device() -> None:
    occ = run([GpuProcess(12345, GPU1, 1024), GpuProcess(600, GPU1, 10)])
    assert occ.busy[GPU1].endswith("(and 1 more)")
    assert len(occ.unleased) == 2


def test_zombie_memory_with_no_process() -> None:
    occ = run([], devices=[device(GPU0, 3000), device(GPU1, 300)])
    assert occ.busy == {GPU0: "zombie memory: 3000 MiB used by no process"}
    assert run([], devices=[device(GPU0, 3000)], zombie_threshold_mib=4096).busy == {}


def test_memory_explained_by_a_process_is_not_zombie() -> None:
    occ = run([GpuProcess(102, GPU0, 1900)], devices=[device(GPU0, 2048)])
    assert occ.busy == {}


def test_process_that_proc_does_not_know_keeps_probe_fields() -> None:
    # Another pid namespace, or a simulated process: /proc has no such pid.
    simulated = GpuProcess(424242, GPU1, 1024, user="carol", command="python3 sim.py")
    occ = run([simulated])
    assert occ.unleased == (simulated,)
    assert occ.busy[GPU1] == "IN USE WITHOUT LEASE by carol: pid 424242 python3, 1024 MiB"
    unknown = run([GpuProcess(424243, GPU1, 5)])
    assert "by an unknown user: pid 424243 ?" in unknown.busy[GPU1]


def test_to_signal_after_grace() -> None:
    occ = run([GpuProcess(12345, GPU1, 1024), GpuProcess(600, GPU2, 10),
               GpuProcess(424242, GPU2, 10)])
    first_seen = {12345: 100.0, 600: 350.0, 424242: 0.0}
    assert to_signal(occ, first_seen, now=400.0, grace_s=300.0) == [12345]
    assert to_signal(occ, first_seen, now=700.0, grace_s=300.0) == [600, 12345]
    assert to_signal(occ, first_seen, now=700.0, grace_s=300.0, protected={600}) == [12345]
    assert to_signal(occ, {}, now=700.0, grace_s=0.0) == []


def test_to_signal_never_root() -> None:
    info = {7: ProcInfo(7, 0, "root", "dcgm", 1, 1)}
    occ = classify([GpuProcess(7, GPU1, 10)], {}, {}, DEVICES, ancestry=ancestry,
                   info=info.get)
    assert occ.busy[GPU1].startswith("IN USE WITHOUT LEASE by root")
    assert to_signal(occ, {7: 0.0}, now=1e9, grace_s=1.0) == []


def test_a_reservation_covers_its_users_processes_on_its_devices_and_nobody_elses() -> None:
    # Alice reserved GPU1 (no process holds a reservation): her pid 600, started from her
    # own shell, is covered there; Bob's pid 12345 on the same device is not.
    reserved = {GPU1: {1001: "L-booked"}}
    occ = run([GpuProcess(600, GPU1, 512), GpuProcess(12345, GPU1, 1024)], reserved=reserved)
    assert occ.matched == {600: "L-booked"}
    assert [p.pid for p in occ.unleased] == [12345]
    assert occ.busy == {GPU1: "IN USE WITHOUT LEASE by bob: pid 12345 python3, 1024 MiB"}
    # On a device she did not reserve her process is unleased as any other.
    occ = run([GpuProcess(600, GPU2, 512)], reserved=reserved)
    assert [p.pid for p in occ.unleased] == [600]


def test_two_users_share_reservations_on_one_device_each_cover_their_own_processes() -> None:
    # Memory shares (issue 35): alice and bob each reserved a share of GPU1.
    occ = run([GpuProcess(600, GPU1, 512), GpuProcess(12345, GPU1, 1024)],
              reserved={GPU1: {1001: "L-alice", 1002: "L-bob"}})
    assert occ.matched == {600: "L-alice", 12345: "L-bob"}
    assert occ.unleased == () and occ.busy == {}
