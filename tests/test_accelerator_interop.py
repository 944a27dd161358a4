"""A script written for Hugging Face Accelerate runs unchanged under a lease's environment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

from vaccel_common.backends import lease_env

ACCELERATE_SCRIPT = """
import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

acc = Accelerator()
torch.manual_seed(0)
x = torch.randn(256, 8)
data = TensorDataset(x, x.sum(dim=1, keepdim=True))
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(data, batch_size=32))
losses = []
for _ in range(5):
    total = 0.0
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        optimizer.step()
        total += loss.item()
    losses.append(total / len(loader))
print(acc.device.type, losses[0], losses[-1])
"""


@pytest.mark.parametrize("simulated", [False, True], ids=["cpu-lease", "simulated-lease"])
def test_accelerate_script_runs_unchanged_under_a_lease(simulated: bool) -> None:
    lease = lease_env(lease_id="L-hf", backend_name="cuda" if simulated else "cpu",
                      device_ids=["GPU-6f1a0c2e-0000-0000-0000-000000000001"] if simulated else [],
                      simulated=simulated)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VACCEL_")}
    env.update(lease)
    result = subprocess.run([sys.executable, "-c", ACCELERATE_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    device, first, last = result.stdout.split()
    assert device == "cpu"  # this machine's torch has no device runtime
    assert float(last) < 0.5 * float(first)
