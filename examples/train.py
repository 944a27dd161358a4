"""A small training job that runs on whatever device its lease brings.

    vaccel run --gpus 1 -- python examples/train.py     # the lease comes from `vaccel run`
    python examples/train.py                            # takes a lease itself

Synthetic regression data and a ~4k-parameter MLP: it finishes in seconds on a CPU, and
nothing in it names a device vendor.
"""

from __future__ import annotations

import argparse
import os

import torch
import vaccel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from vaccel import Accelerator


def synthetic_data(samples: int, features: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    weights = torch.randn(features, 1, generator=gen)
    y = torch.tanh(x @ weights) + 0.05 * torch.randn(samples, 1, generator=gen)
    return TensorDataset(x, y)


def make_model(features: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1)
    )


def train(acc: Accelerator, epochs: int, seed: int) -> tuple[float, float]:
    """Train and return the mean loss of the first and of the last epoch."""
    torch.manual_seed(seed)
    features = 32
    model = make_model(features)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(synthetic_data(2048, features, seed), batch_size=64, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    loss_fn = nn.MSELoss()

    epoch_losses = []
    for epoch in range(epochs):
        total, batches = 0.0, 0
        for x, y in loader:
            acc.zero_grad(optimizer)
            with acc.autocast():
                loss = loss_fn(model(x).float(), y)
            acc.backward(loss)
            acc.step(optimizer)
            total += loss.item()
            batches += 1
        epoch_losses.append(total / batches)
        acc.print(f"epoch {epoch}: loss {epoch_losses[-1]:.4f}")
    return epoch_losses[0], epoch_losses[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if os.environ.get("VACCEL_LEASE_ID"):
        # Started inside a lease (`vaccel run`): the environment already carries it.
        run(Accelerator(), args)
    else:
        with vaccel.lease(gpus=1) as lease:
            run(lease.accelerator, args)


def run(acc: Accelerator, args: argparse.Namespace) -> None:
    first, last = train(acc, args.epochs, args.seed)
    acc.print(f"device {acc.device} ({acc.backend}); loss {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
