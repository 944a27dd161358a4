"""The small training job in mixed precision.

    vaccel run --gpus 1 -- python examples/train_amp.py --amp bfloat16
    python examples/train_amp.py --config accelerator-config.yaml   # amp_config.dtype

The precision comes from --amp, else from the accelerator-config the lease carries
(`amp_config: {dtype: float16 | bfloat16 | none, grad_scaler: true}`). float16 scales the
loss so small gradients survive, and skips the steps whose gradients overflowed;
bfloat16 needs neither. Nothing here names a device vendor.
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


def train(acc: Accelerator, epochs: int, seed: int) -> tuple[float, float]:
    """Train and return the mean loss of the first and of the last epoch."""
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
        total, batches = 0.0, 0
        for x, y in loader:
            acc.zero_grad(optimizer)
            with acc.autocast():
                prediction = model(x)
            # The loss in float32: a reduction in half precision loses the small terms.
            loss = loss_fn(prediction.float(), y)
            acc.backward(loss)
            acc.clip_grad_norm(optimizer, 1.0)
            acc.step(optimizer)
            total += loss.item()
            batches += 1
        epoch_losses.append(total / batches)
        acc.print(f"epoch {epoch}: loss {epoch_losses[-1]:.4f}")
    return epoch_losses[0], epoch_losses[-1]


def run(acc: Accelerator, args: argparse.Namespace) -> None:
    first, last = train(acc, args.epochs, args.seed)
    acc.print(
        f"device {acc.device} ({acc.backend}), amp {acc.amp.dtype or 'none'}, "
        f"skipped steps {acc.skipped_steps}; loss {first:.4f} -> {last:.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--amp", choices=["float16", "bfloat16", "none"],
                        help="precision; default: the lease's accelerator-config")
    parser.add_argument("--config", help="accelerator-config.yaml for a lease taken here")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if os.environ.get("VACCEL_LEASE_ID"):
        # Started inside a lease (`vaccel run`): the environment already carries it.
        run(Accelerator(amp=args.amp), args)
    else:
        with vaccel.lease(gpus=1, config=args.config) as lease:
            acc = (
                lease.accelerator if args.amp is None
                else Accelerator(amp=args.amp, guard=lease.check)
            )
            run(acc, args)


if __name__ == "__main__":
    main()
