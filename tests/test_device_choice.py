"""Which devices a multi-device lease gets (issue 33, item 3): one model whenever the host has
enough free of one, a mix only when it has not, and always in index order, so `cuda:0` is
the lease's lowest-numbered device. The fit rule for one device stays best fit, in one
place a setting (or the lab benchmark) can change."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from brokerd.contract import ClientFacts
from brokerd.leasing.selection import select_devices as select
from tests.conftest import Broker
from tests.mixed_host import A100, T4, gpu, requirement

NO_FACTS = ClientFacts()
A100_40 = replace(A100, name="NVIDIA A100-PCIE-40GB", memory_mib=40960, memory_bandwidth_gbps=1555)


def no_locality(*devices):  # type: ignore[no-untyped-def]
    return [replace(d, numa_node=-1, interconnect_group="") for d in devices]


def indices(devices):  # type: ignore[no-untyped-def]
    return None if devices is None else [d.index for d in devices]


def test_a_pair_is_one_model_when_the_host_has_two_free_of_one():
    # Best fit alone paired the T4 with a 40 GB A100 (the least memory in total).
    host = no_locality(gpu(A100, 0), gpu(A100_40, 1), gpu(A100_40, 2), gpu(T4, 3))
    assert indices(select(requirement(gpus=2, facts=NO_FACTS), host, {})) == [1, 2]


def test_a_mix_only_when_no_model_has_enough_and_then_by_index():
    host = no_locality(gpu(A100, 0), gpu(A100_40, 1), gpu(T4, 2), gpu(T4, 5))
    assert indices(select(requirement(gpus=2, facts=NO_FACTS), host, {})) == [2, 5]  # the two T4s
    mixed = select(requirement(gpus=3, facts=NO_FACTS), host, {})
    assert indices(mixed) == [1, 2, 5]  # no three of a model: the best fit, listed by index


def test_one_model_comes_after_priorities_and_before_locality():
    # Two T4s on different NUMA nodes beat a T4 and an A100 on the same one.
    host = [gpu(A100, 0, numa_node=0, interconnect_group=""), gpu(T4, 1, numa_node=0),
            gpu(T4, 2, numa_node=1)]
    assert indices(select(requirement(gpus=2, facts=NO_FACTS), host, {})) == [1, 2]


def test_the_fit_rule_is_one_argument_best_fit_by_default():
    host = no_locality(gpu(A100, 0), gpu(A100_40, 1), gpu(T4, 2))
    assert indices(select(requirement(facts=NO_FACTS), host, {})) == [2]
    fastest = select(requirement(facts=NO_FACTS), host, {}, prefer=lambda d: -d.memory_bandwidth_gbps)
    assert indices(fastest) == [0]


INVENTORY = """\
devices:
  - {vendor: nvidia, name: NVIDIA A100-SXM4-80GB, uuid: GPU-80, memory_mib: 81920, compute_capability: "8.0"}
  - {vendor: nvidia, name: NVIDIA A100-PCIE-40GB, uuid: GPU-40a, memory_mib: 40960, compute_capability: "8.0"}
  - {vendor: nvidia, name: NVIDIA A100-PCIE-40GB, uuid: GPU-40b, memory_mib: 40960, compute_capability: "8.0"}
  - {vendor: nvidia, name: Tesla T4, uuid: GPU-t4, memory_mib: 15360, compute_capability: "7.5"}
"""


def test_vaccel_run_gets_a_pair_of_one_model_in_index_order(start_broker, tmp_path: Path):
    inventory = tmp_path / "host.yaml"
    inventory.write_text(INVENTORY)
    broker: Broker = start_broker(inventory=inventory)
    r = broker.vaccel("run", "--gpus", "2", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "GPU-40a,GPU-40b"  # cuda:0 is gpu1, the lower index
    assert "gpu1 NVIDIA A100-PCIE-40GB, gpu2 NVIDIA A100-PCIE-40GB" in r.stderr
