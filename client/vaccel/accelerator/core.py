"""`Accelerator`: train on whatever the lease brings, with no vendor name in user code."""

from __future__ import annotations

import builtins
import logging
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader

from vaccel.accelerator import memory
from vaccel.accelerator.amp import AmpPolicy, policy_from
from vaccel.accelerator.distributed import (
    RankInfo,
    ensure_process_group,
    process_group_backend,
    rank_info,
)
from vaccel.accelerator.memory import MemoryCap, MemoryStats
from vaccel.accelerator.notices import NoLeaseWarning, SimulatedDevicesWarning, install
from vaccel.accelerator.placement import DeviceLoader, remake_loader, send_to_device
from vaccel_common.backends import backend as backend_entry

log = logging.getLogger("vaccel.accelerator")
__all__ = ["Accelerator", "NoLeaseWarning", "SimulatedDevicesWarning"]


def _no_guard() -> None:
    return None


class Accelerator:
    """The device, precision and process layout of one process under a lease.

    Built from the environment a lease applies (VACCEL_BACKEND, VACCEL_DEVICES,
    VACCEL_MEMORY_CAP_MIB, VACCEL_SIMULATED, VACCEL_ACCELERATOR_CONFIG) and torchrun's
    RANK / LOCAL_RANK / WORLD_SIZE. Constructing one on a real accelerator initialises the
    device runtime, so do it after the lease exists (`lease.accelerator` does).

    - `env`: the variables to read; default `os.environ`.
    - `guard`: called at the start of every method; it raises when the lease has ended
      (the lease passes its own check), so a job stops instead of computing on a device
      that is no longer its own. DataLoaders from `prepare()` call it once per batch.
    - `amp`: "float16", "bfloat16" or "none"; default: the lease's accelerator-config
      (`amp_config.dtype`), else full precision.

    Out of memory: inside `autocast()`, `backward()`, `step()`, `prepare()` and
    `memory_scope()`, torch's OutOfMemoryError is re-raised with the lease's memory cap
    in its message when the lease carries one.
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        guard: Callable[[], None] | None = None,
        amp: str | None = None,
    ) -> None:
        install()  # its warnings below read as one `vaccel:` line
        self._env: dict[str, str] = dict(os.environ if env is None else env)
        self._guard = guard or _no_guard
        self.lease_id: str = self._env.get("VACCEL_LEASE_ID", "")
        self.simulated: bool = self._env.get("VACCEL_SIMULATED") == "1"
        self.ranks: RankInfo = rank_info(self._env)
        self.amp: AmpPolicy = policy_from(amp, self._env)
        self._lease_devices = [d for d in self._env.get("VACCEL_DEVICES", "").split(",") if d]
        name = self._env.get("VACCEL_BACKEND", "")
        if not name:
            warnings.warn(
                "vaccel: no lease in this process's environment (VACCEL_BACKEND unset); "
                "computing on the CPU. Run under `vaccel run` or inside `with vaccel.lease()` "
                "to use a GPU.",
                NoLeaseWarning,
                stacklevel=2,
            )
            name = "cpu"
        self.backend: str = backend_entry(name).name
        self._owns_process_group = False
        self._wrapped: list[weakref.ref[torch.nn.Module]] = []
        cap = self._memory_cap()
        if self.simulated or backend_entry(name).torch_device_type == "cpu":
            self._device, self._device_count = self._cpu_device()
            self._cap = cap
            if cap is not None:
                log.info("vaccel: %s; not enforceable on the CPU", cap.describe())
        else:
            self._device, self._device_count = self._accelerator_device()
            self._cap = memory.apply_cap(cap, self._device) if cap is not None else None
        self._scaler = (
            torch.amp.GradScaler(self._device.type) if self.amp.grad_scaler else None
        )
        self.skipped_steps: int = 0
        """Optimizer steps skipped because float16 gradients overflowed."""

    # --- where we compute -------------------------------------------------------------

    def _memory_cap(self) -> MemoryCap | None:
        raw = self._env.get("VACCEL_MEMORY_CAP_MIB")
        if not raw:
            return None
        try:
            cap_mib = int(raw)
        except ValueError:
            raise ValueError(f"VACCEL_MEMORY_CAP_MIB must be an integer, got {raw!r}") from None
        return MemoryCap(self.lease_id or "(none)", cap_mib) if cap_mib > 0 else None

    def _cpu_device(self) -> tuple[torch.device, int]:
        if self.simulated:
            # The registry keys on the message, so each lease says this once per process.
            warnings.warn(
                f"vaccel: lease {self.lease_id} holds simulated {self.backend} devices; "
                "computing on the CPU",
                SimulatedDevicesWarning,
                stacklevel=3,
            )
        return torch.device("cpu"), max(1, len(self._lease_devices))

    def _accelerator_device(self) -> tuple[torch.device, int]:
        device_type = backend_entry(self.backend).torch_device_type
        current = torch.accelerator.current_accelerator()
        if current is None or current.type != device_type or not self._build_matches():
            raise RuntimeError(
                f"lease {self.lease_id} holds {self.backend} devices but this torch "
                f"({torch.__version__}) cannot use them; install a torch build for "
                f"{self.backend} in this environment"
            )
        count = torch.accelerator.device_count()
        if self._lease_devices and count != len(self._lease_devices):
            raise RuntimeError(
                f"the device runtime sees {count} device(s) but lease {self.lease_id} holds "
                f"{len(self._lease_devices)}: the runtime started before the lease's "
                "environment applied. Create the lease before any torch device call "
                "(even an availability check)."
            )
        index = self.ranks.local_rank
        if index >= count:
            raise RuntimeError(
                f"LOCAL_RANK {index} has no device: lease {self.lease_id} holds {count}. "
                f"Start at most {count} rank(s) on this host or lease more devices (--gpus)."
            )
        torch.accelerator.set_device_index(index)
        return torch.device(device_type, index), count

    def _build_matches(self) -> bool:
        # ROCm and CUDA builds share torch's cuda device type; only the build tells them apart.
        if self.backend == "rocm":
            return torch.version.hip is not None
        if self.backend == "cuda":
            return torch.version.hip is None
        return True

    @property
    def device(self) -> torch.device:
        """The torch.device this process computes on (LOCAL_RANK's device in a multi-rank job)."""
        self._guard()
        return self._device

    @property
    def device_count(self) -> int:
        """How many devices the lease makes visible to this process."""
        return self._device_count

    @property
    def is_main_process(self) -> bool:
        """True on rank 0 (and in a single-process job)."""
        return self.ranks.is_main

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler under float16 AMP (`backward` and `step` use it), else None."""
        return self._scaler

    def __repr__(self) -> str:
        return (
            f"Accelerator(lease={self.lease_id or None}, backend={self.backend}, "
            f"device={self._device}, amp={self.amp.dtype or 'none'}, "
            f"rank={self.rank}/{self.world_size})"
        )

    # --- preparing objects ------------------------------------------------------------

    def prepare(self, *objs: Any) -> Any:
        """Make objects ready for this device and job; returns them in order (one object
        comes back as itself, several as a tuple).

        - nn.Module: moved to the device; wrapped in DistributedDataParallel when this
          process is one rank of several (the process group is started from torchrun's
          environment if it is not yet, with the backend that suits the lease).
        - DataLoader: rebuilt with pinned memory on an accelerator and, in a multi-rank
          job using torch's default samplers, a DistributedSampler (its epoch advanced on
          every pass); it yields batches already on the device.
        - Tensors (and lists, tuples, dicts of them): moved to the device.
        - Optimizer: returned as is, its state tensors (from a checkpoint) moved along.
        - Anything else (schedulers, ...): returned unchanged.
        """
        self._guard()
        with memory.naming_cap(self._cap):
            prepared = [self._prepare_one(obj) for obj in objs]
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def to_device(self, *objs: Any) -> Any:
        """Move tensors (and lists, tuples, dicts of them) or modules to this device, as
        `prepare` does for them, without wrapping anything for DDP."""
        self._guard()
        with memory.naming_cap(self._cap):
            moved = [obj.to(self._device) if isinstance(obj, torch.nn.Module) else send_to_device(obj, self._device)
                     for obj in objs]
        return moved[0] if len(moved) == 1 else tuple(moved)

    def _prepare_one(self, obj: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(obj, DistributedDataParallel):
            return obj
        if isinstance(obj, torch.nn.Module):
            obj = obj.to(self._device)
            if not self.ranks.distributed:
                return obj
            self._ensure_process_group()
            device_ids = None if self._device.type == "cpu" else [self._device.index]
            wrapped = DistributedDataParallel(obj, device_ids=device_ids)
            self._wrapped.append(weakref.ref(wrapped))
            return wrapped
        if isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(self._device)
            return obj
        if isinstance(obj, DeviceLoader):
            return obj
        if isinstance(obj, DataLoader):
            return DeviceLoader(remake_loader(obj, self._device, self.ranks), self._device,
                                self._guard)
        if isinstance(obj, (torch.Tensor, list, tuple, dict)):
            return send_to_device(obj, self._device)
        return obj

    def _ensure_process_group(self) -> None:
        backend = process_group_backend(self.backend, on_cpu=self._device.type == "cpu")
        if ensure_process_group(backend, self._env):
            self._owns_process_group = True
            log.info("vaccel: rank %d/%d joined a %s process group",
                     self.rank, self.world_size, backend)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's model inside a DistributedDataParallel wrapper (for saving)."""
        return getattr(model, "module", model)

    # --- a training step --------------------------------------------------------------

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """Mixed precision for the forward pass with the configured dtype; a plain
        block in full precision."""
        self._guard()
        dtype = getattr(torch, self.amp.dtype) if self.amp.dtype else None
        with memory.naming_cap(self._cap), torch.autocast(
            self._device.type, dtype=dtype, enabled=self.amp.enabled
        ):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the loss scaled first under float16."""
        self._guard()
        with memory.naming_cap(self._cap):
            if self._scaler is not None:
                self._scaler.scale(loss).backward()
            else:
                loss.backward()

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the gradients of `optimizer`'s parameters to `max_norm` (unscaling them
        first under float16, so the norm is the true one); returns the norm before."""
        self._guard()
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """optimizer.step(); under float16 through the GradScaler, which skips the step
        when gradients overflowed. Returns False for a skipped step (counted in
        `skipped_steps`)."""
        self._guard()
        with memory.naming_cap(self._cap):
            if self._scaler is None:
                optimizer.step()
                return True
            scale = self._scaler.get_scale()
            self._scaler.step(optimizer)
            self._scaler.update()
            # The scaler lowers its scale exactly when it found inf/NaN and skipped.
            if self._scaler.get_scale() < scale:
                self.skipped_steps += 1
                log.debug("vaccel: float16 gradients overflowed; step skipped, scale %g", scale)
                return False
            return True

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients (set to None: cheaper than zero-filling)."""
        self._guard()
        optimizer.zero_grad(set_to_none=True)

    # --- device housekeeping ----------------------------------------------------------

    @contextmanager
    def memory_scope(self) -> Iterator[None]:
        """A block whose OutOfMemoryError names the lease's memory cap, for work done
        outside the accelerator's own methods (e.g. evaluation)."""
        self._guard()
        with memory.naming_cap(self._cap):
            yield

    def memory_stats(self) -> MemoryStats:
        """Current and peak allocator bytes on the device, its size and the lease's cap."""
        self._guard()
        return memory.stats(self._device, self._cap)

    def reset_peak_memory_stats(self) -> None:
        self._guard()
        if self._device.type != "cpu":
            torch.accelerator.reset_peak_memory_stats(self._device.index)

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the device (no-op on the CPU)."""
        self._guard()
        if self._device.type != "cpu":
            torch.accelerator.empty_cache()

    def synchronize(self) -> None:
        """Wait until the device has finished all queued work (no-op on the CPU)."""
        self._guard()
        if self._device.type != "cpu":
            torch.accelerator.synchronize(self._device.index)

    sync = synchronize

    def wait_for_everyone(self) -> None:
        """A barrier across ranks once the process group exists; no-op otherwise."""
        self._guard()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on the main process only."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)

    def close(self) -> None:
        """Tear down the process group this accelerator started, once every rank gets
        here. Safe after the lease ended and more than once.

        Optional: a group left open ends at interpreter exit anyway, safely and without
        waiting for the other ranks (group_end.py). The group is destroyed here only when
        no model this accelerator wrapped for DDP is still alive (drop your references
        first); otherwise it is left to that end.
        """
        if not self._owns_process_group:
            return
        import torch.distributed as dist

        from vaccel.accelerator import group_end

        if not dist.is_initialized():
            self._owns_process_group = False
            return
        # Every rank arrives before any tears its connections down.
        dist.barrier()
        if any(ref() is not None for ref in self._wrapped):
            log.debug("vaccel: a prepared model is alive; the process group ends at exit")
            return
        group_end.let_workers_finish()  # freeing the group waits for its workers, which may want the GIL
        dist.destroy_process_group()
        group_end.forget()
        self._owns_process_group = False
