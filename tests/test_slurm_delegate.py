"""A node Slurm also manages (`[slurm] mode = "delegate"`, brokerd/addons/slurm/) and a login node
(`mode = "submit"`, client/vaccel/slurm/submit.py), on a real single-node Slurm
(bench/testbeds/slurm.py: four fake GPUs) with a real broker as root and real users
(tests/test_multiuser.py's helpers): Slurm is the only allocator, vaccel's leases are
Slurm jobs of the requesting user, bound to the requesting process."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LAB_INVENTORY, ROOT, Broker
from tests.slurm_cluster import SlurmCluster, slurm_fixture  # noqa: F401 - the `slurm` fixture
from tests.test_multiuser import as_user, staged, wait_for  # noqa: F401 - `staged` is a fixture

PY = sys.executable
# Lab inventory uuids end in the device's index + 1.
UUID_INDEX = {f"GPU-6f1a0c2e-0000-0000-0000-00000000000{i + 1}": i for i in range(4)}

# What a job does: record (device, start, end) for each of its GPUs, then end.
RECORD = ('s=$(date +%s.%N); sleep {secs}; e=$(date +%s.%N); '
          'for d in $(echo "{devs}" | tr , " "); do echo "{tag} $d $s $e" >> {out}/{tag}; done')


# -- a delegate-mode broker on the cluster ---------------------------------------------


def _start_delegate(slurm: SlurmCluster, start_broker, monkeypatch, extra: str = "") -> Broker:
    slurm.cancel_all()
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))  # the broker runs Slurm's programs
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-sd-"))
    os.chmod(workdir, 0o755)
    config = f'[leases]\nheartbeat_ttl = "5s"\n[slurm]\nmode = "delegate"\nnode = "{slurm.node}"\n{extra}'
    return start_broker(LAB_INVENTORY, config, workdir=workdir)


@pytest.fixture
def delegate(slurm: SlurmCluster, staged: Path, start_broker, monkeypatch) -> Iterator[Broker]:  # noqa: F811
    """A root broker on the lab inventory whose allocator is Slurm."""
    broker = _start_delegate(slurm, start_broker, monkeypatch)
    yield broker
    broker.stop()
    slurm.cancel_all()


@pytest.fixture
def records() -> Path:
    """A folder where every user's jobs write their intervals, a file per job (a sticky folder
    lets nobody append to another user's file)."""
    folder = Path(tempfile.mkdtemp(prefix="vaccel-sd-rec-"))
    os.chmod(folder, 0o1777)
    return folder


def _really(user: str) -> dict:
    """subprocess keyword arguments for running as `user` with their own groups too (`user=`
    alone keeps root's gid, which group permission bits then judge)."""
    return {"user": user, "group": user, "extra_groups": []}


def _run_as(broker: Broker, staged: Path, user: str, *args: str, popen: bool = False):  # noqa: F811
    kwargs = _really(user)
    return as_user(broker, staged, kwargs.pop("user"), *args, popen=popen, **kwargs)


def _sbatch(slurm: SlurmCluster, user: str, gpus: int, script: str) -> int:
    r = subprocess.run(["sbatch", "--parsable", f"--gres=gpu:{gpus}", "--output=/dev/null", "--wrap", script],
                       env=slurm.env(PATH="/usr/bin:/bin"), cwd="/", capture_output=True, text=True, timeout=30,
                       **_really(user))
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().split(";")[0])


def _job_state(slurm: SlurmCluster, job_id: int) -> str:
    return slurm.run("squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T", timeout=10).stdout.strip()


def _jobs_of(slurm: SlurmCluster, user: str = "") -> list[int]:
    """Every job Slurm still lists (ended ones too, for a while), of one user or all."""
    args = ["-u", user] if user else []
    return [int(j) for j in slurm.run("squeue", "-h", "-t", "all", *args, "-o", "%i", timeout=10).stdout.split()]


def _last_job(slurm: SlurmCluster) -> int:
    return max(_jobs_of(slurm), default=0)


def _status(broker: Broker) -> dict:
    r = broker.vaccel("status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _slurm_job_of(broker: Broker, lease_id: str) -> int:
    r = broker.vaccel("leases", "--all", "--json")
    assert r.returncode == 0, r.stderr
    return int(next(lease for lease in json.loads(r.stdout)["leases"] if lease["id"] == lease_id)["slurm_job_id"])


def test_vaccel_runs_and_batch_jobs_never_overlap_on_a_device(slurm, delegate, staged, records):  # noqa: F811
    runs, batch = [], []
    plan = [("run", "vaccel-alice", 2), ("sbatch", "vaccel-carol", 3), ("run", "vaccel-bob", 1),
            ("sbatch", "vaccel-carol", 2), ("run", "vaccel-alice", 3), ("sbatch", "vaccel-carol", 1)]
    for i, (kind, user, gpus) in enumerate(plan):
        if kind == "run":
            script = RECORD.format(secs=0.6, devs="$VACCEL_DEVICES", tag=f"run{i}", out=records)
            runs.append(_run_as(delegate, staged, user, "run", "--gpus", str(gpus), "--", "sh", "-c", script,
                                popen=True))
        else:
            script = RECORD.format(secs=0.6, devs="$SLURM_JOB_GPUS", tag=f"sbatch{i}", out=records)
            batch.append(_sbatch(slurm, user, gpus, script))
        time.sleep(0.15)
    outputs = []
    for proc in runs:
        _, err = proc.communicate(timeout=90)
        outputs.append(err)
        assert proc.returncode == 0, err
    wait_for(lambda: all(_job_state(slurm, j) == "COMPLETED" for j in batch), timeout=60)
    lines = [line.split() for path in records.iterdir() for line in path.read_text().splitlines()]
    tags = {tag for tag, *_ in lines}
    assert tags == {f"{kind}{i}" for i, (kind, *_) in enumerate(plan)}, "every job ran"
    by_device: dict[int, list[tuple[float, float, str]]] = {}
    for tag, dev, start, end in lines:
        index = UUID_INDEX[dev] if dev.startswith("GPU-") else int(dev)
        by_device.setdefault(index, []).append((float(start), float(end), tag))
    assert sum(len(v) for v in by_device.values()) == sum(g for *_, g in plan)
    for index, spans in by_device.items():
        spans.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            assert start >= end, f"gpu{index}: {a} and {b} overlap"
    # The runs waited in Slurm's queue, and were told so in vaccel's words.
    assert any(re.search(r"waiting for Slurm: job \d+ pending \(\w+\), position \d+ of \d+", e) for e in outputs)


def test_a_sigkilled_vaccel_run_frees_its_allocation_when_its_death_is_seen(slurm, delegate, staged):  # noqa: F811
    """The holder's death ends the lease (holder_exited: the broker's watch on its pid, not a
    heartbeat that stopped coming) and the job is cancelled after it. How long that takes is
    printed, not asserted: on a loaded machine it is the scheduler's (issue 44, item 4)."""
    holder = _run_as(delegate, staged, "vaccel-alice", "run", "--", "sh", "-c", "echo $VACCEL_LEASE_ID; sleep 60",
                     popen=True)
    lease_id = holder.stdout.readline().strip()
    assert lease_id.startswith("l-"), holder.stderr.read()
    job_id = _slurm_job_of(delegate, lease_id)
    assert job_id and _job_state(slurm, job_id) == "RUNNING"
    assert slurm.run("squeue", "-h", "-j", str(job_id), "-o", "%u").stdout.strip() == "vaccel-alice"
    killed_at = time.time()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    wait_for(lambda: _job_state(slurm, job_id) in ("CANCELLED", "COMPLETED"), timeout=15)
    seen_gone = time.time() - killed_at  # includes squeue's own start-up, polled every 50 ms
    pattern = rf"job={job_id} ended_at=([\d.]+) cancelled_at=([\d.]+): cancelled slurm job {job_id}"
    match = wait_for(lambda: re.search(pattern, delegate.log.read_text()), timeout=5)
    ended_at, cancelled_at = float(match.group(1)), float(match.group(2))
    print(f"\nSIGKILL -> lease ended {(ended_at - killed_at) * 1000:.0f} ms, -> scancel done "
          f"{(cancelled_at - killed_at) * 1000:.0f} ms, -> squeue shows it gone {seen_gone * 1000:.0f} ms")
    assert killed_at <= ended_at <= cancelled_at
    assert re.search(rf"{lease_id}\b.*holder_exited|holder_exited.*{lease_id}\b", delegate.log.read_text())


def test_a_contract_the_granted_gpu_cannot_meet_fails_before_the_job_computes(slurm, delegate, staged):  # noqa: F811
    folder = Path(tempfile.mkdtemp(prefix="vaccel-sd-c-"))
    folder.chmod(0o1777)  # alice reads the contracts and would write the marker
    spec, huge, marker = folder / "runtime-spec.yaml", folder / "huge.yaml", folder / "computed"
    spec.write_text("required_features:\n  - min_memory: 60GiB\n")
    huge.write_text("required_features:\n  - min_memory: 100000GiB\n")
    # Nothing on this node can meet it: refused as today, and Slurm is not even asked.
    before = _last_job(slurm)
    r = _run_as(delegate, staged, "vaccel-alice", "run", "--contract", str(huge), "--", "touch", str(marker))
    assert r.returncode == 1 and "no device on this host meets the contract" in r.stderr, r.stderr
    assert _last_job(slurm) == before
    # The two 80 GiB GPUs are held by a batch job: Slurm's grant is the 40 GiB one, which the
    # contract refuses; the allocation is cancelled and the command never starts.
    hold = _sbatch(slurm, "vaccel-carol", 2, "sleep 60")
    wait_for(lambda: _job_state(slurm, hold) == "RUNNING")
    r = _run_as(delegate, staged, "vaccel-alice", "run", "--contract", str(spec), "--", "touch", str(marker))
    assert r.returncode == 1, r.stderr
    assert "gpu2" in r.stderr and "the contract cannot be met" in r.stderr and "cancelled" in r.stderr, r.stderr
    assert not marker.exists()
    (refused,) = [j for j in _jobs_of(slurm, "vaccel-alice") if j > before]
    wait_for(lambda: _job_state(slurm, refused) == "CANCELLED")


def test_batch_jobs_show_in_status_and_waiters_in_the_queue(slurm, delegate, staged):  # noqa: F811
    job = _sbatch(slurm, "vaccel-carol", 4, "sleep 60")
    wait_for(lambda: _job_state(slurm, job) == "RUNNING")
    shown = wait_for(lambda: (s := _status(delegate)) and all(d["lease_id"] for d in s["devices"]) and s)
    assert shown["slurm_mode"] == "delegate"
    for device in shown["devices"]:
        assert device["lease_id"] == f"slurm-{job}" and device["state"] == "leased"
        assert device["holder"]["user"] == "vaccel-carol"
        assert device["holder"]["command"] == f"slurm job {job} (vaccel-carol)"
    text = delegate.vaccel("status")
    assert "slurm: delegate" in text.stdout and f"slurm job {job} (vaccel-carol)" in text.stdout
    # A vaccel run now waits in Slurm's queue: its line names the job, status lists it.
    waiter = _run_as(delegate, staged, "vaccel-bob", "run", "--", "true", popen=True)
    queue = wait_for(lambda: _status(delegate)["queue"])
    (entry,) = queue
    assert entry["requester"]["user"] == "vaccel-bob" and int(entry["slurm_job_id"]) > job and entry["gpus"] == 1
    assert entry["reason"] == f"slurm job {entry['slurm_job_id']} pending: Resources"
    slurm.run("scancel", str(job))
    _, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err
    assert f"waiting for Slurm: job {entry['slurm_job_id']} pending (Resources), position 1 of 1" in err


def test_one_user_cannot_make_the_broker_start_salloc_without_bound(slurm, staged, start_broker,  # noqa: F811
                                                                     monkeypatch):
    """Each request is a salloc the root broker starts: beyond the user's max_waiting the
    next one is refused at once, and nothing is left with Slurm for it."""
    broker = _start_delegate(slurm, start_broker, monkeypatch, "[policy.default]\nmax_waiting = 1\n")
    try:
        job = _sbatch(slurm, "vaccel-carol", 4, "sleep 60")
        wait_for(lambda: _job_state(slurm, job) == "RUNNING")
        first = _run_as(broker, staged, "vaccel-bob", "run", "--", "true", popen=True)
        # Waiting for good: its stream's request is with Slurm (the client's first, unary try
        # with salloc --immediate may show a job in the queue for a moment before it is refused).
        assert "waiting for Slurm" in first.stderr.readline()
        second = _run_as(broker, staged, "vaccel-bob", "run", "--", "true")
        assert second.returncode != 0, second.stderr
        assert "limit max_waiting=1 for default: vaccel-bob already has 1 requests with Slurm" in second.stderr
        live = slurm.run("squeue", "-h", "-u", "vaccel-bob", "-t", "PENDING,RUNNING", "-o", "%i", timeout=10)
        assert len(live.stdout.split()) == 1  # the refused one never reached Slurm
        slurm.run("scancel", str(job))
        _, err = first.communicate(timeout=60)
        assert first.returncode == 0, err
    finally:
        broker.stop()
        slurm.cancel_all()


# -- a login node in submit mode -------------------------------------------------------


def test_submit_mode_runs_the_command_on_two_gpus_with_its_exit_status(slurm, tmp_path):
    slurm.cancel_all()
    config = tmp_path / "brokerd.toml"
    config.write_text('[slurm]\nmode = "submit"\n')
    env = slurm.env(VACCEL_BROKER_CONFIG=str(config), VACCEL_SOCKET=str(tmp_path / "no-broker.sock"))
    cmd = 'echo "job=$SLURM_JOB_ID gpus=$SLURM_STEP_GPUS"; exit 3'
    r = slurm.run(PY, "-m", "vaccel.cli", "run", "--gpus", "2", "--", "sh", "-c", cmd, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 3, r.stdout + r.stderr
    assert re.fullmatch(r"job=\d+ gpus=0,1\n", r.stdout), r.stdout
    r = slurm.run(PY, "-m", "vaccel.cli", "run", "--gpus", "2", "--", "sh", "-c", "kill -TERM $$", env=env,
                  timeout=60)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    r = slurm.run(PY, "-m", "vaccel.cli", "run", "--gpus", "9", "--", "true", env=env, timeout=60)
    assert r.returncode == 1 and "Slurm refused the allocation" in r.stderr, r.stderr


def test_a_restart_re_adopts_live_jobs_and_cancels_those_whose_holder_died(slurm, delegate, staged):  # noqa: F811
    held = []
    for user in ("vaccel-alice", "vaccel-bob"):
        proc = _run_as(delegate, staged, user, "run", "--", "sh", "-c", "echo $VACCEL_LEASE_ID; sleep 60", popen=True)
        lease_id = proc.stdout.readline().strip()
        assert lease_id.startswith("l-"), proc.stderr.read()
        held.append((proc, lease_id, _slurm_job_of(delegate, lease_id)))
    (alice, alice_lease, alice_job), (bob, _, bob_job) = held
    delegate.kill9()
    bob.kill()  # dies while the broker is down: its job must not outlive it
    bob.wait(10)
    delegate.start()
    wait_for(lambda: _job_state(slurm, bob_job) == "CANCELLED")
    assert _job_state(slurm, alice_job) == "RUNNING"
    assert _slurm_job_of(delegate, alice_lease) == alice_job
    assert f"lease {alice_lease} re-adopted with slurm job {alice_job}" in delegate.log.read_text()
    alice.terminate()
    alice.wait(10)
    wait_for(lambda: _job_state(slurm, alice_job) in ("CANCELLED", "COMPLETED"))


def test_an_unknown_slurm_mode_stops_the_start_naming_file_and_key(tmp_path):
    from brokerd.config.loader import ConfigError, load_config

    path = tmp_path / "brokerd.toml"
    path.write_text('[slurm]\nmode = "delegated"\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: slurm.mode must be 'off', 'delegate' or 'submit'"):
        load_config(path)
    path.write_text('[slurm]\nmode = "submit"\npartition = "gpu"\n')
    assert (load_config(path).slurm_mode, load_config(path).slurm_partition) == ("submit", "gpu")
