"""The small training job as one rank of a multi-process job, one device per rank.

    vaccel run --gpus 2 -- torchrun --nproc_per_node 2 examples/train_ddp.py

Every rank inherits the one lease `vaccel run` took, uses LOCAL_RANK's device, trains on
its own shard of the data, and averages gradients with the others. Started by torchrun
without a lease, the ranks compute on the CPU (and say so).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from vaccel import Accelerator


def synthetic_data(samples: int, features: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    weights = torch.randn(features, 1, generator=gen)
    y = torch.tanh(x @ weights) + 0.05 * torch.randn(samples, 1, generator=gen)
    return TensorDataset(x, y)


def train(acc: Accelerator, epochs: int, seed: int) -> list[float]:
    """Train on this rank's shard; returns the loss of each epoch over all ranks."""
    # The same seed on every rank: DDP also broadcasts rank 0's weights at wrap time.
    torch.manual_seed(seed)
    features = 32
    model = nn.Sequential(
        nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(synthetic_data(2048, features, seed), batch_size=64, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    loss_fn = nn.MSELoss()

    epoch_losses = []
    for epoch in range(epochs):
        total = torch.zeros(2, device=acc.device)  # sum of losses, number of batches
        for x, y in loader:
            acc.zero_grad(optimizer)
            with acc.autocast():
                loss = loss_fn(model(x).float(), y)
            acc.backward(loss)
            acc.step(optimizer)
            total += torch.stack([loss.detach(), torch.ones((), device=acc.device)])
        dist.all_reduce(total)
        epoch_losses.append((total[0] / total[1]).item())
        acc.print(f"epoch {epoch}: loss {epoch_losses[-1]:.4f}")
    return epoch_losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    acc = Accelerator()
    losses = train(acc, args.epochs, args.seed)
    acc.print(
        f"{acc.world_size} ranks on {acc.backend}, rank 0 on {acc.device}; "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    acc.close()  # the model is gone with train()'s frame, so the group can end cleanly


if __name__ == "__main__":
    main()
