"""The torch accelerator on the CPU, with the environment set by hand as a lease would."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import (  # noqa: E402
    DataLoader,
    DistributedSampler,
    SequentialSampler,
    TensorDataset,
)
from vaccel.accelerator import (  # noqa: E402
    Accelerator,
    NoLeaseWarning,
    SimulatedDevicesWarning,
    initialised_runtime,
)
from vaccel.accelerator.amp import AmpPolicy, policy_from  # noqa: E402
from vaccel.accelerator.distributed import RankInfo, process_group_backend, rank_info  # noqa: E402
from vaccel.accelerator.placement import DeviceLoader, remake_loader  # noqa: E402

from vaccel_common.backends import lease_env  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CPU_LEASE = lease_env(lease_id="L-cpu", backend_name="cpu", device_ids=[])


class Ended(RuntimeError):
    pass


def regression_data(n: int = 512) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen)
    return TensorDataset(x, y)


def train_losses(acc: Accelerator, epochs: int = 4) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(regression_data(), batch_size=32, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for x, y in loader:
            acc.zero_grad(optimizer)
            with acc.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            acc.step(optimizer)
            total += loss.item()
        losses.append(total / len(loader))
    return losses


def test_training_on_a_cpu_lease_lowers_the_loss() -> None:
    acc = Accelerator(env=CPU_LEASE)
    assert acc.device == torch.device("cpu")
    assert acc.backend == "cpu"
    assert acc.is_main_process and acc.world_size == 1
    losses = train_losses(acc)
    assert losses[-1] < 0.5 * losses[0]


def test_bf16_autocast_on_cpu() -> None:
    acc = Accelerator(env=CPU_LEASE, amp="bfloat16")
    assert acc.amp == AmpPolicy(dtype="bfloat16", grad_scaler=False)
    layer = acc.prepare(nn.Linear(4, 4))
    with acc.autocast():
        out = layer(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    losses = train_losses(Accelerator(env=CPU_LEASE, amp="bfloat16"))
    assert losses[-1] < 0.5 * losses[0]


def test_full_precision_autocast_changes_nothing() -> None:
    acc = Accelerator(env=CPU_LEASE)
    with acc.autocast():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.float32


def test_float16_scales_the_loss_and_skips_overflowing_steps() -> None:
    acc = Accelerator(env=CPU_LEASE, amp="float16")
    assert acc.amp.grad_scaler
    layer = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = layer.weight.detach().clone()
    acc.backward((layer(torch.randn(2, 4)) * float("inf")).sum())
    assert acc.step(optimizer) is False
    assert acc.skipped_steps == 1
    assert torch.equal(layer.weight, before)

    acc.zero_grad(optimizer)
    acc.backward(layer(torch.randn(2, 4)).sum())
    assert acc.step(optimizer) is True
    assert acc.skipped_steps == 1
    assert not torch.equal(layer.weight, before)


def test_float16_training_still_converges() -> None:
    acc = Accelerator(env=CPU_LEASE, amp="float16")
    losses = train_losses(acc)
    assert losses[-1] < 0.5 * losses[0]


def test_clip_grad_norm_sees_unscaled_gradients() -> None:
    acc = Accelerator(env=CPU_LEASE, amp="float16")
    layer = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.ones(1, 4)
    acc.backward(layer(x).sum())
    norm = acc.clip_grad_norm(optimizer, max_norm=1e6)
    # d(sum(w.x + b))/dw = x, /db = 1: the true norm is sqrt(4 + 1), not 65536 times it.
    assert norm.item() == pytest.approx(5**0.5, rel=1e-3)


def test_prepare_handles_each_kind_of_object() -> None:
    acc = Accelerator(env=CPU_LEASE)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(regression_data(64), batch_size=16)
    tensor = torch.zeros(2)
    batch = {"x": torch.zeros(1), "rest": [torch.ones(1), "label"]}

    out = acc.prepare(model, optimizer, scheduler, loader, tensor, batch)
    p_model, p_opt, p_sched, p_loader, p_tensor, p_batch = out
    assert p_model is model  # single process: no wrapper
    assert p_opt is optimizer and p_sched is scheduler
    assert isinstance(p_loader, DeviceLoader) and len(p_loader) == len(loader)
    assert p_loader.batch_size == 16  # the wrapped loader's attributes show through
    x, _ = next(iter(p_loader))
    assert x.device == acc.device and x.shape == (16, 8)
    assert p_tensor.device == acc.device
    assert p_batch["rest"][1] == "label"
    # One object comes back as itself, not a 1-tuple; preparing twice changes nothing.
    assert acc.prepare(p_loader) is p_loader
    assert acc.prepare(model) is model


def test_dataloader_shards_per_rank_in_a_multi_rank_job() -> None:
    ranks = RankInfo(rank=1, local_rank=1, world_size=2)
    shuffled = DataLoader(regression_data(64), batch_size=8, shuffle=True)
    remade = remake_loader(shuffled, torch.device("cpu"), ranks)
    assert isinstance(remade.sampler, DistributedSampler)
    assert remade.sampler.rank == 1 and remade.sampler.num_replicas == 2
    assert remade.sampler.shuffle is True
    assert len(remade) == 4  # half of 8 batches

    custom = DataLoader(regression_data(64), batch_size=8, sampler=list(range(10)))
    assert remake_loader(custom, torch.device("cpu"), ranks) is custom

    single = DataLoader(regression_data(64), batch_size=8)
    assert isinstance(single.sampler, SequentialSampler)
    assert remake_loader(single, torch.device("cpu"), RankInfo()) is single


def test_device_loader_advances_the_sampler_epoch() -> None:
    loader = DataLoader(regression_data(64), batch_size=8, shuffle=True)
    remade = remake_loader(loader, torch.device("cpu"), RankInfo(rank=0, world_size=2))
    wrapped = DeviceLoader(remade, torch.device("cpu"), lambda: None)
    first = [x.clone() for x, _ in wrapped]
    second = [x.clone() for x, _ in wrapped]
    assert wrapped.sampler.epoch == 1
    assert not all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_guard_stops_every_use_after_the_lease_ended() -> None:
    ended = False

    def guard() -> None:
        if ended:
            raise Ended("lease L-cpu ended")

    acc = Accelerator(env=CPU_LEASE, guard=guard)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = acc.prepare(DataLoader(regression_data(64), batch_size=8))
    batches = iter(loader)
    next(batches)
    ended = True
    with pytest.raises(Ended):
        next(batches)
    loss = model(torch.zeros(1, 8)).sum()
    for use in (
        lambda: acc.device,
        lambda: acc.prepare(model),
        lambda: acc.autocast().__enter__(),
        lambda: acc.backward(loss),
        lambda: acc.step(optimizer),
        lambda: acc.zero_grad(optimizer),
        acc.synchronize,
        acc.empty_cache,
        acc.memory_stats,
    ):
        with pytest.raises(Ended):
            use()
    acc.close()  # cleanup still works after the lease ended


def test_simulated_lease_computes_on_cpu_without_the_device_runtime(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a simulated lease touched the device runtime")

    for name in ("is_available", "device_count", "set_device", "set_per_process_memory_fraction"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    env = lease_env(lease_id="L-sim", backend_name="cuda", device_ids=["GPU-1", "GPU-2"],
                    memory_cap_mib=1024, simulated=True)
    # torch's own optimizers ask torch.accelerator during training; the accelerator must
    # not ask it at all.
    with monkeypatch.context() as during_init:
        for name in ("is_available", "device_count", "current_accelerator", "set_device_index"):
            during_init.setattr(torch.accelerator, name, forbidden)
        with pytest.warns(SimulatedDevicesWarning, match="L-sim.*simulated cuda.*CPU"):
            acc = Accelerator(env=env)
    assert acc.device == torch.device("cpu")
    assert acc.backend == "cuda" and acc.device_count == 2
    losses = train_losses(acc, epochs=2)
    assert losses[-1] < losses[0]
    assert acc.memory_stats().cap_mib == 1024
    assert not torch.cuda.is_initialized()


def test_real_lease_on_a_torch_without_that_runtime_is_refused() -> None:
    if torch.accelerator.is_available():
        pytest.skip("this torch has a device runtime")
    env = lease_env(lease_id="L-real", backend_name="cuda", device_ids=["GPU-1"])
    with pytest.raises(RuntimeError, match="L-real holds cuda devices but this torch"):
        Accelerator(env=env)


def test_no_lease_computes_on_cpu_and_says_so() -> None:
    with pytest.warns(NoLeaseWarning, match="no lease"):
        acc = Accelerator(env={})
    assert acc.device == torch.device("cpu") and acc.backend == "cpu"


def test_out_of_memory_names_the_lease_cap() -> None:
    acc = Accelerator(env={**CPU_LEASE, "VACCEL_MEMORY_CAP_MIB": "512"})
    with pytest.raises(torch.OutOfMemoryError, match="lease L-cpu caps this process at 512 MiB"):
        with acc.memory_scope():
            raise torch.OutOfMemoryError("tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError, match=r"512 MiB.*tried to allocate"):
        with acc.autocast():
            raise torch.OutOfMemoryError("tried to allocate 2.00 GiB")
    # Without a cap torch's own error passes through untouched.
    plain = Accelerator(env=CPU_LEASE)
    with pytest.raises(torch.OutOfMemoryError, match=r"^tried to allocate 2\.00 GiB$"):
        with plain.memory_scope():
            raise torch.OutOfMemoryError("tried to allocate 2.00 GiB")


def test_memory_stats_on_cpu_report_no_allocator() -> None:
    stats = Accelerator(env=CPU_LEASE).memory_stats()
    assert stats.device == "cpu" and stats.allocated_bytes is None and stats.cap_mib is None


def test_amp_policy_from_the_lease_config(tmp_path: Path) -> None:
    config = tmp_path / "accelerator-config.yaml"
    config.write_text("amp_config:\n  dtype: float16\n  grad_scaler: false\n")
    env = {"VACCEL_ACCELERATOR_CONFIG": str(config)}
    assert policy_from(None, env) == AmpPolicy("float16", grad_scaler=False)
    config.write_text("amp_config:\n  dtype: bfloat16\n  grad_scaler: true\n")
    assert policy_from(None, env) == AmpPolicy("bfloat16", grad_scaler=False)
    config.write_text("backend: cuda\n")
    assert policy_from(None, env) == AmpPolicy()
    assert policy_from("fp16", env) == AmpPolicy("float16", grad_scaler=True)  # argument wins
    assert policy_from(None, {}) == AmpPolicy()
    with pytest.raises(ValueError, match="use float16, bfloat16 or none"):
        policy_from("int8", {})
    with pytest.raises(ValueError, match="cannot read accelerator config"):
        policy_from(None, {"VACCEL_ACCELERATOR_CONFIG": str(tmp_path / "missing.yaml")})


def test_rank_environment_and_process_group_backend() -> None:
    assert rank_info({}) == RankInfo()
    info = rank_info({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"})
    assert info.distributed and not info.is_main and info.local_rank == 1
    with pytest.raises(ValueError, match="inconsistent"):
        rank_info({"RANK": "4", "WORLD_SIZE": "4"})
    assert process_group_backend("cuda", on_cpu=False) == "nccl"
    assert process_group_backend("rocm", on_cpu=False) == "nccl"
    assert process_group_backend("cuda", on_cpu=True) == "gloo"
    assert process_group_backend("cpu", on_cpu=True) == "gloo"


def test_multi_rank_without_a_rendezvous_is_refused() -> None:
    acc = Accelerator(env={**CPU_LEASE, "RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT not set"):
        acc.prepare(nn.Linear(2, 2))


def test_print_only_on_the_main_process(capsys) -> None:
    Accelerator(env={**CPU_LEASE, "RANK": "1", "WORLD_SIZE": "2"}).print("from rank 1")
    Accelerator(env=CPU_LEASE).print("from rank 0")
    assert capsys.readouterr().out == "from rank 0\n"


def test_initialised_runtime_with_torch_but_no_device_runtime() -> None:
    assert initialised_runtime() is None


def test_initialised_runtime_reads_torch_flags(monkeypatch) -> None:
    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_initialized=lambda: True),
        xpu=types.SimpleNamespace(is_initialized=lambda: False),
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert initialised_runtime() == "cuda"


def test_initialised_runtime_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from vaccel.accelerator.runtime_state import initialised_runtime\n"
        "print(initialised_runtime(), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.split() == ["None", "False"]


def test_example_trains_under_a_cpu_lease() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--epochs", "3"],
        env={**_base_env(), **CPU_LEASE}, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    first_loss, last_loss = (float(v) for v in last.rsplit("loss ", 1)[1].split(" -> "))
    assert "device cpu (cpu)" in last and last_loss < 0.5 * first_loss


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_amp_example_reads_the_lease_config(tmp_path: Path, dtype: str) -> None:
    config = tmp_path / "accelerator-config.yaml"
    config.write_text(f"amp_config:\n  dtype: {dtype}\n  grad_scaler: true\n")
    env = {**_base_env(), **CPU_LEASE, "VACCEL_ACCELERATOR_CONFIG": str(config)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_amp.py"), "--epochs", "2"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"amp {dtype}" in result.stdout.splitlines()[-1]


def test_gpu_check_script_dry_run_measures_three_precisions() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check_accelerator.py"), "--dry-run",
         "--model", "resnet", "--markdown"],
        env={**_base_env(), **CPU_LEASE}, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["fp32", "fp16 + GradScaler", "bf16"]
    assert all("n/a" in row for row in rows[1:])  # the CPU keeps no allocator statistics


def test_examples_name_no_vendor() -> None:
    words = ("cuda", "hip", "nvml", "amdsmi", "xpu", "rocm", "nccl")
    for path in [*(ROOT / "examples").glob("*.py"), ROOT / "scripts" / "gpu_check_accelerator.py"]:
        text = path.read_text().lower()
        assert not [w for w in words if w in text], path


def _base_env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("VACCEL_")}
    env.pop("WORLD_SIZE", None)
    return env
