"""Inside a Slurm job the job's allocation is the lease (client/vaccel/slurm/job.py), on a
real single-node Slurm (bench/testbeds/slurm.py): four fake GPUs, no vaccel broker unless a
test starts one. Every job runs as root with this interpreter."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster, slurm_fixture  # noqa: F401 - the `slurm` fixture

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# Prints what the job's process sees: the lease, the GPUs Slurm gave, the accelerator's ranks.
PROBE = """\
import os, vaccel
with vaccel.lease() as l:
    acc = vaccel.init_accelerator()
    print("LEASE", l.id, l.backend, l.simulated, ",".join(d.visible_id for d in l.devices),
          os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS"),
          acc.rank, acc.world_size, acc.ranks.local_rank, acc.device, flush=True)
"""


@pytest.fixture
def job_env(slurm: SlurmCluster, tmp_path: Path) -> dict[str, str]:
    """Client env for jobs: no lease of ours, and a broker socket where there is none, so a
    job that tried to reach a broker would fail loudly."""
    env = slurm.env(VACCEL_SOCKET=str(tmp_path / "no-broker.sock"), PYTHONUNBUFFERED="1")
    for key in ("VACCEL_LEASE_ID", "VACCEL_BACKEND", "VACCEL_SLURM", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    return env


def _lease_line(stdout: str) -> list[list[str]]:
    return sorted(line.split()[1:] for line in stdout.splitlines() if line.startswith("LEASE "))


def test_train_runs_unchanged_under_srun_and_sees_the_jobs_gpu(slurm, job_env, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    r = slurm.run("srun", "--gres=gpu:1", "sh", "-c", f"{PY} {probe} && {PY} examples/train.py --epochs 2",
                  cwd=ROOT, env=job_env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = _lease_line(r.stdout)
    job_id = line[0].removeprefix("slurm-").split(".")[0]
    assert line[0] == f"slurm-{job_id}.0"
    # backend from the device file (major 195), simulated: no driver behind the node
    assert line[1:5] == ["cuda", "True", "0", "0"]
    assert line[5:8] == ["0", "1", "0"] and line[8] == "cpu"
    assert "device cpu (cuda); loss" in r.stdout
    assert f"lease slurm-{job_id}.0 holds simulated cuda devices" in r.stderr


def test_train_runs_unchanged_under_sbatch_with_two_gpus(slurm, job_env, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/sh\nset -e\ncd {ROOT}\n{PY} {probe}\n{PY} examples/train.py --epochs 2\n")
    out = tmp_path / "job.out"
    r = slurm.run("sbatch", "--gres=gpu:2", "--wait", f"--output={out}", str(script), env=job_env, timeout=120)
    text = out.read_text() if out.exists() else ""
    assert r.returncode == 0, r.stdout + r.stderr + text
    (line,) = _lease_line(text)
    job_id = r.stdout.split()[-1]
    # A batch script is no srun step: the lease is the job's, with both its GPUs.
    assert line[:5] == [f"slurm-{job_id}", "cuda", "True", "0,1", "0,1"]
    assert line[5:8] == ["0", "1", "0"]
    assert "device cpu (cuda); loss" in text


def test_vaccel_run_inside_srun_runs_the_command_on_the_jobs_devices_without_a_broker(slurm, job_env):
    cmd = 'echo "$VACCEL_LEASE_ID $VACCEL_DEVICES $CUDA_VISIBLE_DEVICES $VACCEL_SIMULATED"; exit 7'
    r = slurm.run("srun", "--gres=gpu:2", PY, "-m", "vaccel.cli", "run", "--", "sh", "-c", cmd, env=job_env)
    assert r.returncode == 7, r.stdout + r.stderr
    lease_id, devices, visible, simulated = r.stdout.split()
    assert lease_id.startswith("slurm-") and lease_id.endswith(".0")
    assert (devices, visible, simulated) == ("0,1", "0,1", "1")
    assert f"vaccel: lease {lease_id} (Slurm job): gpu0 nvidia0, gpu1 nvidia1 (simulated)" in r.stderr
    assert "released" not in r.stderr  # Slurm ends the allocation, not us


def test_vaccel_run_inside_srun_reports_a_signal_as_128_plus_n(slurm, job_env):
    r = slurm.run("srun", "--gres=gpu:1", PY, "-m", "vaccel.cli", "run", "--", "sh", "-c", "kill -TERM $$",
                  env=job_env)
    assert r.returncode == 143, r.stdout + r.stderr


def test_two_tasks_see_ranks_0_and_1(slurm, job_env, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    r = slurm.run("srun", "-n", "2", "--gres=gpu:2", PY, str(probe), env=job_env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _lease_line(r.stdout)
    assert [line[5:8] for line in lines] == [["0", "2", "0"], ["1", "2", "1"]]
    assert {line[3] for line in lines} == {"0,1"}


DDP_STEP = ROOT / "tests" / "ddp_unclosed_step.py"  # ends without close(): vaccel ends its group
REPEAT_RUNS, REPEAT_FOR_S = 12, 60.0


def test_two_srun_tasks_train_together_without_torchrun_and_always_exit_cleanly(slurm, job_env):
    """`srun -n 2` alone (no torchrun, no MASTER_ADDR/PORT): prepare() derives where the
    tasks meet from Slurm's variables, and an all-reduce sees both ranks. The script never
    closes the group: left to the interpreter's end, a gloo group used to abort a rank at
    exit now and then (exit 134, pytorch/pytorch#190489); repeated, no run may."""
    runs = 0
    deadline = time.monotonic() + REPEAT_FOR_S
    while runs < REPEAT_RUNS and (runs == 0 or time.monotonic() < deadline):
        r = slurm.run("srun", "-n", "2", "--gres=gpu:2", PY, str(DDP_STEP), env=job_env, timeout=180)
        runs += 1
        assert r.returncode == 0, f"run {runs}: " + r.stdout + r.stderr
        assert "terminate called" not in r.stderr
        lines = sorted(line for line in r.stdout.splitlines() if line.startswith("rank "))
        assert lines == ["rank 0 of 2 sum 3.0 DistributedDataParallel",
                         "rank 1 of 2 sum 3.0 DistributedDataParallel"]


def test_the_rendezvous_of_an_srun_step_is_derived_alike_in_every_task():
    from vaccel.accelerator.distributed import first_host, slurm_rendezvous

    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NODELIST": "gpu[07-08]"}
    seen = [slurm_rendezvous({**step, "SLURM_PROCID": str(rank)}) for rank in range(4)]
    meeting = {(s["MASTER_ADDR"], s["MASTER_PORT"], s["WORLD_SIZE"]) for s in seen}
    assert meeting == {("gpu07", seen[0]["MASTER_PORT"], "4")}
    assert [s["RANK"] for s in seen] == ["0", "1", "2", "3"] and 20000 <= int(seen[0]["MASTER_PORT"]) < 40000
    assert slurm_rendezvous({**step, "SLURM_STEP_NUM_NODES": "1"})["MASTER_ADDR"] == "127.0.0.1"
    assert slurm_rendezvous({"SLURM_JOB_ID": "1"}) == {}  # a batch script: no step, nothing derived
    assert [first_host(n) for n in ("node01", "gpu[03-05,09],cpu01", "a,b")] == ["node01", "gpu03", "a"]


def test_lease_inside_a_job_fails_fast_when_the_job_lacks_gpus(slurm, job_env):
    code = "import vaccel\nwith vaccel.lease(gpus=2): pass\n"
    r = slurm.run("srun", "--gres=gpu:1", PY, "-c", code, env=job_env)
    assert r.returncode != 0
    assert "holds 1 GPU(s) and 2 were asked for: submit with --gres=gpu:2" in r.stderr
    r = slurm.run("srun", PY, "-m", "vaccel.cli", "run", "--", "true", env=job_env)
    assert r.returncode != 0
    assert "Slurm gave it no GPUs" in r.stderr


def test_opting_out_asks_the_broker(slurm, job_env):
    r = slurm.run("srun", "--gres=gpu:1", PY, "-m", "vaccel.cli", "run", "--", "true",
                  env={**job_env, "VACCEL_SLURM": "off"})
    assert r.returncode != 0
    assert "cannot reach the vaccel broker" in r.stderr


def test_a_contract_without_a_broker_is_said_unchecked(slurm, job_env, tmp_path):
    spec = tmp_path / "runtime-spec.yaml"
    spec.write_text("required_features:\n  - min_memory: 1GiB\n")
    r = slurm.run("srun", "--gres=gpu:1", PY, "-m", "vaccel.cli", "run", "--contract", str(spec), "--", "true",
                  env=job_env)
    assert r.returncode == 0, r.stderr
    assert "was NOT checked against this node's devices: no vaccel broker is reachable" in r.stderr


def test_a_contract_the_node_cannot_meet_fails_before_the_job_computes(slurm, job_env, broker, tmp_path):
    spec = tmp_path / "runtime-spec.yaml"
    spec.write_text("required_features:\n  - min_memory: 100000GiB\n")
    marker = tmp_path / "computed"
    code = f"import vaccel\nwith vaccel.lease(contract={str(spec)!r}):\n    open({str(marker)!r}, 'w')\n"
    r = slurm.run("srun", "--gres=gpu:1", PY, "-c", code, env={**job_env, "VACCEL_SOCKET": str(broker.socket)},
                  timeout=60)
    assert r.returncode != 0
    assert "the contract cannot be met on this node" in r.stderr and "NOT satisfiable" in r.stderr
    assert not marker.exists()
