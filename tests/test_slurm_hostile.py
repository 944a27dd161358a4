"""A hostile neighbour against a node Slurm also manages (issue 31 items 1, 2, 3 and the
Slurm papercut of 10): a delegate-mode broker as root on the real single-node Slurm of
bench/testbeds/slurm.py, the attacker a real Unix user (vaccel-alice; her attacks in
tests/slurm_attacker.py), the neighbour a well-behaved one (vaccel-bob) whose
`vaccel run --no-wait --gpus 1 -- true` is timed while each attack runs (printed; never
asserted on). docs/security.md maps each class to its mechanism and to the test here.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, Broker
from tests.slurm_cluster import SlurmCluster, slurm_fixture  # noqa: F401 - the `slurm` fixture
from tests.test_multiuser import staged, wait_for  # noqa: F401 - `staged` is a fixture
from tests.test_slurm_delegate import (  # noqa: F401 - `delegate` is a fixture
    _job_state,
    _run_as,
    _sbatch,
    _slurm_job_of,
    _status,
    delegate,
)

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="hostile Slurm tests need root (users, the test cluster)"),
]

HOLD_AND_PRINT = "echo $VACCEL_LEASE_ID $VACCEL_DEVICES; sleep 60"


@pytest.fixture(scope="module")
def attacker(staged: Path) -> Path:  # noqa: F811
    shutil.copy(ROOT / "tests" / "slurm_attacker.py", staged / "slurm_attacker.py")
    os.chmod(staged / "slurm_attacker.py", 0o644)
    return staged / "slurm_attacker.py"


def _attack(attacker: Path, user: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(attacker), *args], user=user, group=user, extra_groups=[],
                            env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _said(proc: subprocess.Popen[str]) -> dict:
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return json.loads(line)


def _stop(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _lease(broker: Broker, lease_id: str) -> dict:
    r = broker.vaccel("leases", "--all", "--json")
    assert r.returncode == 0, r.stderr
    return next(lease for lease in json.loads(r.stdout)["leases"] if lease["id"] == lease_id)


def _owner(slurm: SlurmCluster, job_id: int) -> str:
    return slurm.run("squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%u", timeout=10).stdout.strip()


def _sbatch_as(slurm: SlurmCluster, user: str, *options: str) -> int:
    r = subprocess.run(["sbatch", "--parsable", "--output=/dev/null", *options, "--wrap", "sleep 120"],
                       env=slurm.env(PATH="/usr/bin:/bin"), cwd="/", capture_output=True, text=True, timeout=30,
                       user=user, group=user, extra_groups=[])
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().split(";")[0])


def _seen(broker: Broker, job: int) -> dict:
    """The status once a poll has seen Slurm job `job` (waiting, or holding devices)."""
    def shown() -> dict | None:
        status = _status(broker)
        named = {q.get("slurm_job_id") for q in status["queue"]} | {d["lease_id"] for d in status["devices"]}
        return status if {str(job), job, f"slurm-{job}"} & named else None

    return wait_for(shown)


def well_behaved(broker: Broker, staged: Path) -> subprocess.CompletedProcess[str]:  # noqa: F811
    """Bob's `vaccel run --no-wait --gpus 1 -- true`, timed (the figure the issue asks for)."""
    start = time.monotonic()
    r = _run_as(broker, staged, "vaccel-bob", "run", "--no-wait", "--gpus", "1", "--", "true")
    print(f"\nwell-behaved `vaccel run --no-wait --gpus 1 -- true`: exit {r.returncode} in "
          f"{time.monotonic() - start:.2f}s")
    return r


def test_a_forged_grant_on_the_sallocs_pipe_takes_no_one_elses_gpu(slurm, delegate, staged, attacker):  # noqa: F811
    """Item 1: the broker learns the granted job from Slurm, by a mark only its request's job
    carries, owned by the requester; what salloc's pipe says is only a hint to look."""
    bob = _run_as(delegate, staged, "vaccel-bob", "run", "--", "sh", "-c", HOLD_AND_PRINT, popen=True)
    alice = forger = None
    try:
        bob_lease, bob_device = bob.stdout.readline().split()
        bob_job = _slurm_job_of(delegate, bob_lease)
        # The other three GPUs, until alice holds a copy of her waiting salloc's stderr (a
        # filler that ended on its own could let salloc finish first on a loaded machine).
        filler = _sbatch(slurm, "vaccel-carol", 3, "sleep 120")
        _seen(delegate, filler)  # so alice's request waits in Slurm's queue
        forger = _attack(attacker, "vaccel-alice", "forge-grant", str(bob_job))
        alice = _run_as(delegate, staged, "vaccel-alice", "run", "--", "sh", "-c", HOLD_AND_PRINT, popen=True)
        assert "holding" in _said(forger)  # alice holds a copy of her salloc's stderr
        slurm.run("scancel", str(filler))
        alice_line = alice.stdout.readline().split()
        assert alice_line, alice.stderr.read()
        alice_lease, alice_device = alice_line
        assert _said(forger)["forged"] == str(bob_job)
        time.sleep(2.5)  # two polls: whatever the forged line could have started has happened
        assert alice_device != bob_device
        alice_job = _slurm_job_of(delegate, alice_lease)
        assert alice_job != bob_job and _owner(slurm, alice_job) == "vaccel-alice"
        assert _lease(delegate, bob_lease)["state"] == "active" and bob.poll() is None
        assert _slurm_job_of(delegate, bob_lease) == bob_job and _job_state(slurm, bob_job) == "RUNNING"
        r = well_behaved(delegate, staged)
        assert r.returncode == 0, r.stderr
    finally:
        _stop(*(p for p in (forger, alice, bob) if p is not None))
    wait_for(lambda: _job_state(slurm, bob_job) in ("CANCELLED", "COMPLETED"))


def test_a_requests_mark_on_another_job_is_never_taken_for_it(slurm, delegate, staged, attacker):  # noqa: F811
    """Item 1's neighbours: the mark is in salloc's argv for anyone to read. On another
    user's job it is ignored (the owner must be the requester); on another job of the
    requester's own, the request is refused and every job carrying its mark is cancelled."""
    # The filler keeps alice's salloc pending until the attack has read its mark (a filler
    # that ended on its own could let salloc finish first on a loaded machine).
    filler = _sbatch(slurm, "vaccel-carol", 4, "sleep 120")
    _seen(delegate, filler)
    alice = _run_as(delegate, staged, "vaccel-alice", "run", "--", "sh", "-c", HOLD_AND_PRINT, popen=True)
    try:
        mark = _said(_attack(attacker, "vaccel-alice", "mark"))["comment"]
        assert mark
        decoy = _sbatch_as(slurm, "vaccel-carol", "--hold", "--gres=gpu:1", f"--comment={mark}")
        slurm.run("scancel", str(filler))
        alice_lease, _ = alice.stdout.readline().split()
        alice_job = _slurm_job_of(delegate, alice_lease)
        assert alice_job != decoy and _owner(slurm, alice_job) == "vaccel-alice"
        assert _job_state(slurm, decoy) == "PENDING"  # carol's job is carol's business
    finally:
        _stop(alice)
    filler = _sbatch(slurm, "vaccel-carol", 4, "sleep 120")
    _seen(delegate, filler)
    alice = _run_as(delegate, staged, "vaccel-alice", "run", "--", "true", popen=True)
    try:
        mark = _said(_attack(attacker, "vaccel-alice", "mark"))["comment"]
        own = _sbatch_as(slurm, "vaccel-alice", "--hold", "--gres=gpu:1", f"--comment={mark}")
        _, err = alice.communicate(timeout=60)
        assert alice.returncode != 0 and "more than one Slurm job" in err, err
        wait_for(lambda: _job_state(slurm, own) == "CANCELLED")
        marked = slurm.run("squeue", "-h", "-t", "all", "-u", "vaccel-alice", "-o", "%i %T %k", timeout=10).stdout
        assert all(state == "CANCELLED" for _, state, comment in map(str.split, marked.splitlines())
                   if comment == mark), marked
    finally:
        _stop(alice)
        slurm.run("scancel", str(filler))


def test_a_job_name_that_reads_like_another_users_running_job_is_only_a_name(slurm, delegate, staged):  # noqa: F811
    """Item 2: Slurm's jobs are read from `squeue --json`; a name is data, never fields."""
    bob = pwd.getpwnam("vaccel-bob")
    name = (f"x JobState=RUNNING UserId=vaccel-bob({bob.pw_uid}) Nodes={slurm.node} CPU_IDs=0 Mem=0 "
            f"GRES=gpu:4(IDX:0-3) TresPerNode=gres:gpu:4")
    job = _sbatch_as(slurm, "vaccel-alice", "--hold", "--gres=gpu:1", f"--job-name={name}")
    _seen(delegate, job)

    def nothing_held_and_named_as_sent(shown: dict) -> None:
        assert not any(d["lease_id"] for d in shown["devices"]), shown["devices"]
        assert not any(d["holder"] and d["holder"]["user"] == "vaccel-bob" for d in shown["devices"])

    shown = _status(delegate)
    nothing_held_and_named_as_sent(shown)
    (entry,) = shown["queue"]
    assert entry["requester"]["user"] == "vaccel-alice" and int(entry["slurm_job_id"]) == job
    assert entry["requester"]["command"] == f"slurm job {job} (vaccel-alice): {name}"
    r = well_behaved(delegate, staged)
    assert r.returncode == 0, r.stderr
    slurm.run("scancel", str(job))
    wait_for(lambda: not _status(delegate)["queue"])
    nothing_held_and_named_as_sent(_status(delegate))
    r = well_behaved(delegate, staged)
    assert r.returncode == 0, r.stderr


def test_pending_jobs_that_cannot_take_the_free_gpus_do_not_refuse_no_wait(slurm, delegate, staged):  # noqa: F811
    """Item 3: whether a request starts now is Slurm's answer (salloc --immediate), not the
    broker's guess from its queue; a held, a dependent and a later job are no reason."""
    r = well_behaved(delegate, staged)  # the figure with nothing pending, to compare
    assert r.returncode == 0, r.stderr
    held = _sbatch_as(slurm, "vaccel-carol", "--hold", "--gres=gpu:4")
    _sbatch_as(slurm, "vaccel-carol", "--gres=gpu:4", f"--dependency=afterok:{held}")
    _sbatch_as(slurm, "vaccel-carol", "--gres=gpu:4", "--begin=now+300")
    wait_for(lambda: len(_status(delegate)["queue"]) == 3)
    r = well_behaved(delegate, staged)
    assert r.returncode == 0, r.stderr
    # A job ahead that could run now keeps what it waits for: Slurm's rule, said so.
    running = _sbatch(slurm, "vaccel-carol", 1, "sleep 60")
    wait_for(lambda: _job_state(slurm, running) == "RUNNING")
    ahead = _sbatch_as(slurm, "vaccel-carol", "--gres=gpu:4")
    wait_for(lambda: len(_status(delegate)["queue"]) == 4)
    r = well_behaved(delegate, staged)
    assert r.returncode == 75, r.stderr
    assert f"slurm job {ahead} (vaccel-carol) is ahead in Slurm's queue" in r.stderr, r.stderr


def test_a_pending_job_shows_its_submit_time_never_a_start_to_come(slurm, delegate, staged):  # noqa: F811
    """Item 10 (Slurm part): a pending job has no start; what Slurm plans (StartTime of a
    job that begins later) is never shown as a holder's since, nor as a negative age."""
    name = f"later JobState=RUNNING Nodes={slurm.node} CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0)"
    job = _sbatch_as(slurm, "vaccel-alice", "--begin=now+300", "--gres=gpu:1", f"--job-name={name}")
    submitted = slurm.run("squeue", "-h", "-j", str(job), "-o", "%V", timeout=10).stdout.strip()
    shown = _seen(delegate, job)
    assert not any(d["lease_id"] for d in shown["devices"]), shown["devices"]
    (entry,) = shown["queue"]
    assert time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(entry["since"])) == submitted
    text = delegate.vaccel("status").stdout
    assert not re.search(r"\(-\d", text) and not re.search(r"waiting -\d", text), text
