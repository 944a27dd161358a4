"""Putting data on the device: nested batches, and DataLoaders that hand out batches
already there (pinned host memory, per-rank shards in multi-rank jobs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from vaccel.accelerator.distributed import RankInfo


def send_to_device(obj: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """`obj` with every tensor inside it (dicts, lists, tuples, namedtuples) on `device`.

    Anything that is not a tensor or a container of them comes back unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        return type(obj)(  # type: ignore[call-arg]
            {k: send_to_device(v, device, non_blocking=non_blocking) for k, v in obj.items()}
        )
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(send_to_device(v, device, non_blocking=non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(send_to_device(v, device, non_blocking=non_blocking) for v in obj)
    return obj


class DeviceLoader:
    """A DataLoader whose batches arrive on the accelerator's device.

    Each batch first passes the lease guard, so a job whose lease ended stops at the
    next batch instead of computing on a device that is no longer its own. Attributes
    it does not define (dataset, batch_size, sampler, ...) are the wrapped loader's.
    """

    def __init__(
        self, loader: DataLoader, device: torch.device, guard: Callable[[], None]
    ) -> None:
        self.loader = loader
        self.device = device
        self._guard = guard
        self._epoch = 0

    def __iter__(self) -> Iterator[Any]:
        # A DistributedSampler reshuffles only when told the epoch; users forget.
        set_epoch = getattr(self.loader.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self._epoch)
        self._epoch += 1
        non_blocking = self.loader.pin_memory and self.device.type != "cpu"
        for batch in self.loader:
            self._guard()
            yield send_to_device(batch, self.device, non_blocking=non_blocking)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


def remake_loader(loader: DataLoader, device: torch.device, ranks: RankInfo) -> DataLoader:
    """The same loader, rebuilt only where the device or the job needs it to differ:
    pinned memory on an accelerator, and a per-rank shard of the dataset in a multi-rank
    job whose loader uses torch's default samplers (a custom sampler is left alone)."""
    pin = device.type != "cpu"
    shard = ranks.distributed and _default_sampler(loader)
    if loader.pin_memory == pin and not shard:
        return loader
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": pin,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "in_order": loader.in_order,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if isinstance(loader.dataset, IterableDataset):
        # An IterableDataset has no sampler to set; it shards itself if it wants to.
        return DataLoader(
            loader.dataset, batch_size=loader.batch_size, drop_last=loader.drop_last, **kwargs
        )
    sampler = loader.sampler
    if shard:
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=ranks.world_size,
            rank=ranks.rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
        )
    if loader.batch_size is None and loader.batch_sampler is not None:
        # Built with the user's own batch_sampler: keep it (it excludes the other options).
        return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **kwargs)
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=sampler,
        drop_last=loader.drop_last, **kwargs,
    )


def _default_sampler(loader: DataLoader) -> bool:
    return loader.batch_size is not None and type(loader.sampler) in (
        RandomSampler,
        SequentialSampler,
    )
