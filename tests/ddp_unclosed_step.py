"""A DDP step that leaves its ending to vaccel: the model stays alive and neither
Accelerator.close() nor destroy_process_group() is called, as many scripts end. Under
`srun -n 2` (no torchrun) or torchrun; `--peer-dies` makes rank 1 vanish without any
interpreter shutdown right after the group is up, so rank 0 ends beside a dead peer."""

import os
import sys

import torch
import torch.distributed as dist
import vaccel

acc = vaccel.Accelerator()
model = acc.prepare(torch.nn.Linear(4, 1))  # joins (or makes) the step's process group
if "--peer-dies" in sys.argv and acc.rank == 1:
    os._exit(0)
total = torch.tensor([float(acc.rank + 1)])
if "--peer-dies" not in sys.argv:
    dist.all_reduce(total)
# One write per line: both ranks share the pipe, and print() writes its pieces one by one unbuffered.
sys.stdout.write(f"rank {acc.rank} of {acc.world_size} sum {total.item()} {type(model).__name__}\n")
sys.stdout.flush()
