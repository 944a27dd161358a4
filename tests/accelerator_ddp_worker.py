"""One rank of the 2-rank DDP test (started by torchrun from test_accelerator_ddp.py).

Writes what it saw to $DDP_OUT/rank<RANK>.json."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from vaccel.accelerator import Accelerator


def train(acc: Accelerator) -> dict:
    torch.manual_seed(acc.rank)  # different initial weights: DDP must sync them
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(256))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    seen: list[list[int]] = []  # sample indices per epoch, in order
    losses = []
    for _ in range(3):
        total = 0.0
        seen.append([])
        for xb, yb, index in loader:
            seen[-1].extend(index.tolist())
            acc.zero_grad(optimizer)
            with acc.autocast():
                loss = nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)
            acc.step(optimizer)
            total += loss.item()
        losses.append(total / len(loader))
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    return {
        "wrapped": isinstance(model, DistributedDataParallel),
        "backend": dist.get_backend(),
        "sampler_rank": loader.sampler.rank if isinstance(loader.sampler, DistributedSampler)
        else None,
        "batches": len(loader),
        "samples_seen": seen,
        "losses": losses,
        "checksum": checksum,
    }


def main() -> None:
    acc = Accelerator()
    report = train(acc)
    gc.collect()
    acc.wait_for_everyone()
    acc.close()
    report.update(
        rank=acc.rank, world_size=acc.world_size, device=str(acc.device),
        group_destroyed=not dist.is_initialized(), lease=acc.lease_id,
    )
    out = Path(os.environ["DDP_OUT"]) / f"rank{acc.rank}.json"
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
