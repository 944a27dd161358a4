"""The vendor-agnostic article's own train.py, changed only in its imports, runs under
`vaccel run` and inside `with vaccel.lease()`; the names it relies on (init_accelerator,
backend, prepare, backward, step, is_main_process, scaler, to_device, sync, empty_cache)
exist and do what they say."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
ARTICLE = ROOT / "examples" / "article"
SIMULATED_LEASE = {"VACCEL_BACKEND": "cuda", "VACCEL_SIMULATED": "1", "VACCEL_LEASE_ID": "l-sim",
                   "VACCEL_DEVICES": "GPU-1"}


def epoch_losses(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"^Epoch \d+, Loss: ([0-9.]+)$", stdout, re.MULTILINE)]


def assert_trained(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Using accelerator: cuda" in result.stdout  # the lease's backend; simulated devices
    losses = epoch_losses(result.stdout)
    assert len(losses) == 10, result.stdout
    assert losses[-1] < losses[0], losses


def test_the_article_script_differs_from_the_article_only_in_its_imports():
    script = (ARTICLE / "train.py").read_text()
    imports = [ln for ln in script.splitlines() if ln.startswith(("from ", "import "))]
    assert imports == ["from vaccel import init_accelerator",
                       "from model import MedicalSegmentationModel, get_dataloader",
                       "import torch", "import torch.nn.functional as F"]
    for line in ("accelerator = init_accelerator()", "model, dataloader = accelerator.prepare(model, dataloader)",
                 "accelerator.backward(loss)", "accelerator.step(optimizer)", "if accelerator.is_main_process:"):
        assert line in script


@pytest.fixture
def script_dir(tmp_path: Path) -> Path:
    """train.py and model.py alone: the article's contract files beside them pin torch
    2.1, which this machine's torch is not (tests/test_article_contract.py checks them)."""
    for name in ("train.py", "model.py"):
        (tmp_path / name).write_text((ARTICLE / name).read_text())
    return tmp_path


def test_the_article_script_under_vaccel_run(broker, script_dir):
    result = broker.vaccel("run", "--gpus", "1", "--", sys.executable, "train.py", cwd=script_dir, timeout=180)
    assert_trained(result)


def test_the_article_script_inside_with_lease(broker, script_dir):
    code = "import vaccel, train\nwith vaccel.lease(gpus=1) as held:\n    train.main()\n    print('held', held.id)\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=script_dir, env=broker.env,
                            capture_output=True, text=True, timeout=180)
    assert_trained(result)
    assert re.search(r"^held l-", result.stdout, re.MULTILINE)


def test_init_accelerator_is_the_leases_own_accelerator_inside_with_lease(broker, monkeypatch):
    import vaccel

    monkeypatch.setenv("VACCEL_SOCKET", str(broker.socket))
    assert vaccel.current_lease() is None
    with vaccel.lease(gpus=1) as held:
        assert vaccel.current_lease() is held
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", vaccel.accelerator.SimulatedDevicesWarning)  # said elsewhere
            assert vaccel.init_accelerator() is held.accelerator
        with pytest.raises(TypeError, match="uses that lease's accelerator"):
            vaccel.init_accelerator(amp="float16")
    assert vaccel.current_lease() is None


def test_init_accelerator_under_vaccel_run_reads_the_environment(monkeypatch):
    import vaccel

    for key, value in SIMULATED_LEASE.items():
        monkeypatch.setenv(key, value)
    with pytest.warns(vaccel.accelerator.SimulatedDevicesWarning):
        acc = vaccel.init_accelerator(amp="float16")
    assert (acc.backend, acc.lease_id, acc.device.type) == ("cuda", "l-sim", "cpu")


def test_the_semantic_methods(monkeypatch):
    from vaccel.accelerator import Accelerator, SimulatedDevicesWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SimulatedDevicesWarning)
        acc = Accelerator(env=SIMULATED_LEASE, amp="float16")
        plain = Accelerator(env=SIMULATED_LEASE, amp="none")
    assert isinstance(acc.scaler, torch.amp.GradScaler) and plain.scaler is None
    x, model = acc.to_device(torch.ones(2), torch.nn.Linear(2, 1))
    assert x.device == acc.device and next(model.parameters()).device == acc.device
    assert isinstance(model, torch.nn.Linear)  # moved, never wrapped
    batch = acc.to_device({"x": torch.zeros(1), "y": [torch.zeros(1)]})
    assert batch["y"][0].device == acc.device
    acc.sync()
    acc.empty_cache()
    assert acc.sync == acc.synchronize


def test_the_simulated_devices_warning_is_one_vaccel_line():
    code = "from vaccel.accelerator import Accelerator\nAccelerator()\n"
    env = {"PATH": "/usr/bin:/bin", **SIMULATED_LEASE}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if "simulated" in ln or "Warning" in ln]
    assert lines == ["vaccel: lease l-sim holds simulated cuda devices; computing on the CPU"], result.stderr
