"""Inside a Slurm job, the job's allocation is the lease.

Slurm's gres plugin already gave this job its GPUs, exclusively, and made them visible
(SLURM_STEP_GPUS under srun, SLURM_JOB_GPUS in a batch script, and the visible-devices
variables of every runtime). Asking a broker for devices again would queue a second time
for what the job holds and could double-book the node. So `lease()`, `vaccel run` and
`init_accelerator()` take the job's GPUs as the lease: at once, with no broker, nothing to
heartbeat and nothing to release (Slurm ends the allocation with the job).

    lease id    slurm-<jobid>[.<stepid>]
    devices     the GRES indices Slurm assigned, as the runtime sees them
    backend     from the device files in gres.conf (vaccel_common.backends), or VACCEL_BACKEND
    simulated   when those files cannot be opened (a device node with no driver behind it):
                the accelerator then computes on the CPU and says so

VACCEL_SLURM=off turns this off (the broker is asked as everywhere else).

A contract inside a job is checked by the node's broker when one is reachable (its Check
RPC, against the node's probed devices). With none there is nothing in the client that
can probe the devices (that is the daemon's job), so the lease says, as a warning on
stderr and in `lease.warnings`, that the contract was NOT checked. A contract the broker
finds unsatisfiable fails the lease before the job computes.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping

from vaccel.session.lease import Lease, LeaseError
from vaccel_common.backends import GRES_AUTODETECT_BACKENDS, backend, backend_of_device_file
from vaccel_common.v1 import broker_pb2 as pb

_NO_DRIVER = (errno.ENXIO, errno.ENODEV)
_cache: dict[tuple[int, str], Lease] = {}


def in_job(env: Mapping[str, str] = os.environ) -> bool:
    """True inside a Slurm job (and VACCEL_SLURM is not "off")."""
    return bool(env.get("SLURM_JOB_ID")) and env.get("VACCEL_SLURM", "").lower() != "off"


def job_gpus(env: Mapping[str, str] = os.environ) -> list[int]:
    """The GRES indices of the GPUs Slurm assigned to this step (or batch script)."""
    raw = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS") or ""
    return [int(i) for i in raw.split(",") if i.strip().isdigit()]


def lease_id(env: Mapping[str, str] = os.environ) -> str:
    step = env.get("SLURM_STEP_ID", "")
    return f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")


def job_lease(env: Mapping[str, str] = os.environ) -> Lease | None:
    """The job's allocation as a Lease (cached per process), or None outside a job or in a
    job with no GPUs. Raises LeaseError when the devices' backend cannot be told."""
    if not in_job(env):
        return None
    gpus = job_gpus(env)
    if not gpus:
        return None
    key = (os.getpid(), lease_id(env))
    if key not in _cache:
        _cache[key] = _build(env, gpus)
    return _cache[key]


def lease_for(gpus: int, *, contract: str | os.PathLike[str] | None, config: str | os.PathLike[str] | None,
              socket: str | os.PathLike[str] | None, in_process: bool) -> Lease | None:
    """What `lease()` and `vaccel run` get inside a job: the job's lease once it is known to
    fit (`gpus` at most what the job holds, the contract checked or said unchecked); None
    outside a job. Fails fast (LeaseError) instead of queueing."""
    if not in_job():
        return None
    held = job_lease()
    if held is None:
        raise LeaseError(
            f"this is Slurm job {os.environ['SLURM_JOB_ID']}, and Slurm gave it no GPUs: ask Slurm for them "
            "(srun/sbatch --gres=gpu:N or --gpus=N); VACCEL_SLURM=off asks the node's vaccel broker instead",
            code="slurm_no_gpus")
    if gpus > len(held.devices):
        raise LeaseError(
            f"Slurm job {os.environ['SLURM_JOB_ID']} holds {len(held.devices)} GPU(s) and {gpus} were asked for: "
            f"submit with --gres=gpu:{gpus}", code="slurm_too_few_gpus")
    check_contract(held, contract, config, socket, in_process)
    return held


def _build(env: Mapping[str, str], gpus: list[int]) -> Lease:
    files = _gres_files(env)
    paths = [files[i] if i < len(files) else "" for i in gpus]
    name = env.get("VACCEL_BACKEND", "") or _backend_of(paths, env)
    if not name:
        raise LeaseError(
            f"cannot tell which runtime drives this Slurm job's GPUs (no device files for them in "
            f"{_gres_conf(env)}); set VACCEL_BACKEND in the job's environment (one of the backend names "
            "in `vaccel status`)", code="slurm_backend_unknown")
    b = backend(name)
    # The ids the runtime must use are the ones Slurm put in its variable: renumbered
    # 0..n-1 where Slurm confines the job's devices (cgroups), the node's indices otherwise.
    shown = env.get(b.visible_devices_vars[0], "") if b.visible_devices_vars else ""
    ids = [i for i in shown.split(",") if i] or [str(i) for i in gpus]
    simulated = any(no_driver(p) for p in paths if p)
    msg = pb.Lease(id=lease_id(env), backend=b.name, simulated=simulated, state="active")
    for index, path, visible in zip(gpus, paths, ids, strict=False):
        msg.devices.add(index=index, uuid=path or f"gres-gpu-{index}", name=os.path.basename(path) if path else "gpu",
                        backend=b.name, simulated=simulated, visible_id=visible, healthy=True)
    return Lease(msg, joined=False)


def no_driver(path: str) -> bool:
    """A device file with no driver behind it (a fake GPU, an unloaded module)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        return exc.errno in _NO_DRIVER
    return False


def _gres_conf(env: Mapping[str, str]) -> str:
    """A str, not a Path: every `vaccel run` imports this module, and pathlib costs ~9 ms."""
    return os.path.join(os.path.dirname(env.get("SLURM_CONF", "/etc/slurm/slurm.conf")), "gres.conf")


def _expand(text: str) -> list[str]:
    """Slurm's bracket ranges: /dev/gpu[0-3,5] -> the five names, node[01-02] -> two."""
    match = re.search(r"\[([^\]]+)\]", text)
    if not match:
        return [text]
    head, tail = text[: match.start()], text[match.end():]
    out = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(_expand(f"{head}{n:0{width}d}{tail}"))
    return out


def _gres_lines(env: Mapping[str, str]) -> list[dict[str, str]]:
    """gres.conf as key=value records (the file is small and readable by every user)."""
    try:
        with open(_gres_conf(env), errors="replace") as file:
            text = file.read()
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            records.append({k.lower(): v for k, _, v in (w.partition("=") for w in line.split())})
    return records


def _for_this_node(record: dict[str, str], node: str) -> bool:
    return "nodename" not in record or node in _expand(record["nodename"])


def _gres_files(env: Mapping[str, str]) -> list[str]:
    """This node's gpu device files in GRES index order (Slurm numbers them as listed)."""
    node = env.get("SLURMD_NODENAME", "")
    return [f for r in _gres_lines(env) if r.get("name") == "gpu" and "file" in r and _for_this_node(r, node)
            for f in _expand(r["file"])]


def _backend_of(paths: list[str], env: Mapping[str, str]) -> str:
    for path in paths:
        if path and (found := backend_of_device_file(path)):
            return found
    node = env.get("SLURMD_NODENAME", "")
    for record in _gres_lines(env):
        detected = record.get("autodetect", "").lower()
        if detected in GRES_AUTODETECT_BACKENDS and _for_this_node(record, node):
            return GRES_AUTODETECT_BACKENDS[detected]
    return ""


def check_contract(held: Lease, contract: str | os.PathLike[str] | None, config: str | os.PathLike[str] | None,
                    socket: str | os.PathLike[str] | None, in_process: bool) -> None:
    """Check the contract with the node's broker, or say plainly that it was not checked."""
    from vaccel.contract.files import load_contract_files

    files = load_contract_files(contract, config, os.getcwd())
    if files.empty:
        return
    from vaccel.contract.report import render_check
    from vaccel.session.connection import BrokerConnection, BrokerUnavailable

    request = pb.CheckRequest(
        runtime_spec_yaml=files.spec_text, runtime_spec_name=files.spec_name,
        accelerator_config_yaml=files.config_text, accelerator_config_name=files.config_name,
        gpus=len(held.devices))
    if in_process:
        from vaccel.contract.facts import gather_facts  # imports torch: only for the job's own interpreter

        request.client.CopyFrom(gather_facts(files.packages))
    conn = BrokerConnection(socket)
    try:
        reply = conn.call("Check", request, timeout=10.0)
    except BrokerUnavailable:
        note = (f"contract: {files.spec_name or files.config_name} was NOT checked against this node's devices: "
                "no vaccel broker is reachable on this node (its probes do the checks); the job runs unchecked")
        if note not in held.warnings:
            held.warnings.append(note)
        return
    finally:
        conn.close()
    if not reply.satisfiable:
        raise LeaseError(f"Slurm job lease {held.id}: the contract cannot be met on this node:\n"
                         f"{render_check(reply)}", code="unsatisfiable")


class NoSession:
    """What `vaccel run` supervises a job's lease with: Slurm keeps it, so nothing to beat."""

    def start_heartbeat(self) -> None:
        return None
