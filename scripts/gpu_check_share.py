"""GPU check of memory shares (issue 35), run by scripts/gpu_check.sh under
`vaccel run --memory SIZE` on a GPU the daemon shares by memory.

    --role within   allocate half the share through the accelerator (its allocator is
                    capped below the share), hold it, and print what NVML measures for this
                    process against what torch's allocator holds: the difference is the
                    runtime's own context, which vaccel_common/backends.py's
                    SHARE_CONTEXT_RESERVE_MIB estimates. Exits 0.
    --role past     allocate 1.25x the share through the accelerator: the allocator must
                    refuse it (OutOfMemoryError naming the lease's cap). Then do what a job
                    that ignores the cap does (fraction back to 1.0) and hold 1.5x the share:
                    the broker warns, then stops this process. Exits 3 if nobody stops it.

Numbers are measured, never estimated; the output says which is which.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pynvml
import torch
import vaccel

MIB = 1024 * 1024


def measured_mib() -> int:
    """What NVML says this process uses on the leased device (what the broker compares)."""
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(os.environ["CUDA_VISIBLE_DEVICES"])
        used = sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                   if p.pid == os.getpid())
        return used // MIB
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("within", "past"), required=True)
    parser.add_argument("--hold", type=float, default=30.0, help="seconds to hold the memory (within)")
    args = parser.parse_args()
    share = int(os.environ["VACCEL_MEMORY_SHARE_MIB"])
    accelerator = vaccel.init_accelerator()
    device = accelerator.device
    print(f"lease {os.environ['VACCEL_LEASE_ID']}: share {share} MiB, allocator cap "
          f"{os.environ['VACCEL_MEMORY_CAP_MIB']} MiB, {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}", flush=True)
    if args.role == "within":
        block = torch.empty(share // 2 * MIB, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved(device) // MIB
        nvml = measured_mib()
        print(f"measured: torch reserves {reserved} MiB, NVML sees {nvml} MiB for this process: the context "
              f"outside the allocator takes {nvml - reserved} MiB (SHARE_CONTEXT_RESERVE_MIB estimates it)", flush=True)
        time.sleep(args.hold)
        del block
        return 0
    try:
        torch.empty(share * 5 // 4 * MIB, dtype=torch.uint8, device=device)
        print("FAIL: the allocator let this process take more than its share", flush=True)
        return 2
    except torch.OutOfMemoryError as err:
        print(f"capped as it should be: {str(err).splitlines()[0][:200]}", flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0, device)  # a job that ignores the cap
    hog = torch.empty(share * 3 // 2 * MIB, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    print(f"holding {hog.numel() // MIB} MiB past the share; NVML sees {measured_mib()} MiB", flush=True)
    time.sleep(120)
    print("FAIL: still running 120 s after going over the share", flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
