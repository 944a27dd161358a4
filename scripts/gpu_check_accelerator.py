"""GPU check of the accelerator: one model trained in fp32, fp16 (+ GradScaler) and bf16
under a real lease; prints step time and peak device memory for each.

    vaccel run --gpus 1 -- python scripts/gpu_check_accelerator.py          # on a GPU host
    python scripts/gpu_check_accelerator.py                                 # takes a lease itself
    python scripts/gpu_check_accelerator.py --dry-run                       # tiny, CPU is fine

Numbers are measured, never estimated: on the CPU the memory column says n/a because
torch keeps no allocator statistics there. --markdown prints the table for docs/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import vaccel
from torch import nn
from vaccel.accelerator import Accelerator

MODES = ("none", "float16", "bfloat16")
LABELS = {"none": "fp32", "float16": "fp16 + GradScaler", "bfloat16": "bf16"}


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + x)


def resnet(width: int, classes: int = 100) -> nn.Module:
    """A small ResNet-style network: a stem, three stages of two residual blocks."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
    ]
    channels = width
    for stage in range(3):
        if stage:
            layers += [nn.Conv2d(channels, channels * 2, 3, stride=2, padding=1, bias=False),
                       nn.BatchNorm2d(channels * 2), nn.ReLU(inplace=True)]
            channels *= 2
        layers += [Block(channels), Block(channels)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


def transformer(width: int, layers: int, vocab: int = 1000) -> nn.Module:
    layer = nn.TransformerEncoderLayer(width, nhead=max(1, width // 64),
                                       dim_feedforward=4 * width, batch_first=True)
    return nn.Sequential(nn.Embedding(vocab, width), nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                         nn.Linear(width, vocab))


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def workload(kind: str, dry_run: bool) -> Workload:
    if kind == "resnet":
        size, batch, width = (16, 8, 8) if dry_run else (64, 256, 64)
        return Workload(
            f"resnet(width={width}) batch {batch} of 3x{size}x{size}",
            lambda: resnet(width),
            lambda g: (torch.randn(batch, 3, size, size, generator=g),
                       torch.randint(0, 100, (batch,), generator=g)),
            nn.functional.cross_entropy,
        )
    seq, batch, width, depth = (16, 4, 64, 1) if dry_run else (512, 32, 768, 6)
    return Workload(
        f"transformer(d={width}, layers={depth}) batch {batch}x{seq} tokens",
        lambda: transformer(width, depth),
        lambda g: (torch.randint(0, 1000, (batch, seq), generator=g),
                   torch.randint(0, 1000, (batch, seq), generator=g)),
        lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
    )


@dataclass(frozen=True)
class Result:
    mode: str
    device: str
    step_ms: float
    peak_mib: float | None
    first_loss: float
    last_loss: float
    skipped: int


def measure(acc: Accelerator, work: Workload, steps: int, warmup: int) -> Result:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = work.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = acc.prepare(model, optimizer)
    batches = [acc.prepare(work.batch(gen)) for _ in range(4)]  # data stays on the device
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(warmup + steps):
        x, y = batches[step % len(batches)]
        acc.synchronize()
        start = time.perf_counter()
        acc.zero_grad(optimizer)
        with acc.autocast():
            out = model(x)
        loss = work.loss(out.float(), y)
        acc.backward(loss)
        acc.step(optimizer)
        acc.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = acc.memory_stats().max_allocated_bytes
    return Result(
        mode=acc.amp.dtype or "none", device=str(acc.device),
        step_ms=1000 * statistics.median(times),
        peak_mib=None if peak is None else peak / 2**20,
        first_loss=losses[0], last_loss=losses[-1], skipped=acc.skipped_steps,
    )


def table(work: Workload, results: list[Result], markdown: bool) -> str:
    base = results[0]
    rows = [("precision", "step (median)", "speed-up", "peak memory", "memory vs fp32",
             "loss first -> last", "skipped")]
    for r in results:
        mem = "n/a" if r.peak_mib is None else f"{r.peak_mib:.0f} MiB"
        mem_ratio = ("n/a" if r.peak_mib is None or not base.peak_mib
                     else f"{r.peak_mib / base.peak_mib:.2f}x")
        rows.append((LABELS[r.mode], f"{r.step_ms:.2f} ms", f"{base.step_ms / r.step_ms:.2f}x",
                     mem, mem_ratio, f"{r.first_loss:.3f} -> {r.last_loss:.3f}", str(r.skipped)))
    title = f"{work.name} on {results[0].device}"
    if markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(rows[0]) + " |",
                 "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title] + ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                       for row in rows]
    return "\n".join(lines)


def run(guard: Callable[[], None] | None, args: argparse.Namespace) -> None:
    steps, warmup = (5, 1) if args.dry_run else (args.steps, args.warmup)
    kinds = ["resnet", "transformer"] if args.model == "all" else [args.model]
    print(f"torch {torch.__version__}, float32 matmul precision "
          f"{torch.get_float32_matmul_precision()}, {steps} timed steps after {warmup} warm-up")
    for kind in kinds:
        work = workload(kind, args.dry_run)
        results = []
        for mode in MODES:
            acc = Accelerator(guard=guard, amp=mode)
            results.append(measure(acc, work, steps, warmup))
            acc.empty_cache()
        print()
        print(table(work, results, args.markdown))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet", "transformer", "all"], default="all")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--markdown", action="store_true", help="print markdown tables")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny models and 5 steps: checks the script itself, e.g. on a CPU")
    args = parser.parse_args()
    if os.environ.get("VACCEL_LEASE_ID"):
        run(None, args)  # started by `vaccel run`: the lease is already in the environment
    elif args.dry_run:
        # No broker needed to check the script: without a lease it computes on the CPU.
        run(None, args)
    else:
        with vaccel.lease(gpus=1) as lease:
            run(lease.check, args)


if __name__ == "__main__":
    main()
