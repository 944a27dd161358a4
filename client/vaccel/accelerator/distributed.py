"""One rank of a multi-process job: where it sits (from torchrun's environment) and which
torch.distributed backend suits the lease's devices."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass

from vaccel_common.backends import backend as backend_entry

# torchrun's rendezvous variables: with all of them present, env:// initialisation works.
_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job; a single process is rank 0 of 1."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info(env: Mapping[str, str]) -> RankInfo:
    """Read RANK / LOCAL_RANK / WORLD_SIZE as torchrun sets them; without them, Slurm's
    SLURM_PROCID / SLURM_LOCALID / SLURM_STEP_NUM_TASKS where srun started the tasks (a
    batch script has no step, and its SLURM_NTASKS counts tasks it has not started)."""
    if "RANK" not in env and "WORLD_SIZE" not in env and "SLURM_STEP_NUM_TASKS" in env:
        env = {"RANK": env.get("SLURM_PROCID", "0"), "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
               "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"]}
    try:
        world_size = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local_rank = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError as err:
        raise ValueError(f"RANK, LOCAL_RANK and WORLD_SIZE must be integers: {err}") from err
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ValueError(
            f"inconsistent rank environment: RANK={rank} LOCAL_RANK={local_rank} "
            f"WORLD_SIZE={world_size}"
        )
    return RankInfo(rank=rank, local_rank=local_rank, world_size=world_size)


def slurm_rendezvous(env: Mapping[str, str]) -> dict[str, str]:
    """Where the tasks of an `srun -n N` step meet when no torchrun set MASTER_ADDR and
    MASTER_PORT: the step's first node, and a port every task derives alike from the job
    and step ids (20000-39999, so two steps of one node rarely meet on one port). Empty
    outside an srun step."""
    if "SLURM_STEP_NUM_TASKS" not in env or "SLURM_JOB_ID" not in env:
        return {}
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    single = env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")) == "1"
    first = first_host(nodes)
    try:
        port = 20000 + (int(env["SLURM_JOB_ID"]) * 31 + int(env.get("SLURM_STEP_ID", "0") or 0)) % 20000
    except ValueError:
        return {}
    return {"MASTER_ADDR": "127.0.0.1" if single or not first else first, "MASTER_PORT": str(port),
            "RANK": env.get("SLURM_PROCID", "0"), "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"]}


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: "gpu[03-05,09],cpu01" -> "gpu03"."""
    head = nodelist.split(",", 1)[0] if "[" not in nodelist.split(",", 1)[0] else nodelist
    name, bracket, rest = head.partition("[")
    if not bracket:
        return name.strip()
    first = rest.split("]", 1)[0].split(",", 1)[0].split("-", 1)[0]
    return f"{name}{first}".strip()


def process_group_backend(backend_name: str, *, on_cpu: bool) -> str:
    """The torch.distributed backend for ranks computing on `backend_name`'s devices.

    Ranks on the CPU (cpu leases, simulated devices) use gloo whatever the lease's vendor.
    Intel devices use torch's built-in xccl where this torch has it, else oneCCL's
    `ccl` from the separately installed oneccl_bindings_for_pytorch.
    """
    import torch.distributed as dist

    if on_cpu:
        return "gloo"
    name = backend_entry(backend_name).dist_backend
    if name == "xccl" and not _xccl_available(dist):
        if importlib.util.find_spec("oneccl_bindings_for_pytorch") is None:
            raise RuntimeError(
                "this torch has no xccl backend and oneccl_bindings_for_pytorch is not "
                "installed; install a torch build with XPU distributed support"
            )
        import oneccl_bindings_for_pytorch  # noqa: F401  registers the "ccl" backend

        return "ccl"
    return name


def _xccl_available(dist: object) -> bool:
    check = getattr(dist, "is_xccl_available", None)
    return bool(check and check())


def ensure_process_group(backend: str, env: Mapping[str, str]) -> bool:
    """Initialise the default process group from torchrun's env unless one exists.

    Returns True when this call created it (so the caller knows to destroy it); a group
    made here is also ended at interpreter exit, whatever the script does (group_end.py)."""
    import torch.distributed as dist

    from vaccel.accelerator.group_end import end_at_exit

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; multi-rank jobs need it")
    if dist.is_initialized():
        return False
    env = {**slurm_rendezvous(env), **env}
    missing = [var for var in _RENDEZVOUS_VARS if var not in env]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE > 1 but {', '.join(missing)} not set; start the job with torchrun "
            "or call torch.distributed.init_process_group before prepare()"
        )
    if all(os.environ.get(var) == env[var] for var in _RENDEZVOUS_VARS):
        # env:// joins torchrun's own store (TORCHELASTIC_USE_AGENT_STORE) instead of
        # trying to bind MASTER_PORT a second time.
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
        )
    end_at_exit(dist.group.WORLD)
    return True
