"""The lab-trace benchmark (bench/lab): its arithmetic on hand-made cases, and a tiny trace
replayed end to end against a real broker (and a real Slurm, where the machine has one).

Only shapes and sanity are checked, never a timing: figures depend on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.lab import plan, replay_slurm, trace
from bench.lab.metrics import Outcome, figures, idle_while_waiting, jain, service_rates
from bench.testbeds.slurm_accounting import missing_programs as accounting_missing
from tests.slurm_cluster import missing_programs

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {"utilization", "idle_while_waiting_s", "wait_p50_s", "wait_p90_s", "wait_max_s", "jain", "makespan_s",
           "slowdown_user_median", "slowdown_user_max", "jobs", "device_hours", "per_user"}

# Six jobs on two devices: a 2-GPU job that must wait, an interactive hold, jobs with and
# without --time.
TINY = [
    {"user": "ann", "submit_s": 0, "gpus": 1, "duration_s": 1800, "time_limit_s": 0, "kind": "batch"},
    {"user": "bob", "submit_s": 60, "gpus": 1, "duration_s": 900, "time_limit_s": 3600, "kind": "batch"},
    {"user": "cat", "submit_s": 120, "gpus": 2, "duration_s": 600, "time_limit_s": 0, "kind": "batch"},
    {"user": "ann", "submit_s": 180, "gpus": 1, "duration_s": 1200, "time_limit_s": 0, "kind": "interactive"},
    {"user": "dan", "submit_s": 240, "gpus": 1, "duration_s": 2400, "time_limit_s": 3600, "kind": "batch"},
    {"user": "bob", "submit_s": 300, "gpus": 1, "duration_s": 600, "time_limit_s": 0, "kind": "batch"},
]


def _o(job_id: int, gpus: int, submit: float, start: float, end: float, user: str = "u") -> Outcome:
    return Outcome(job_id, user, gpus, submit, start, end)


def test_idle_while_waiting_counts_only_devices_a_waiter_could_use() -> None:
    outcomes = [
        _o(1, 2, 0, 0, 100),      # holds 2 of 4 until 100
        _o(2, 4, 10, 100, 200),   # waits 10..100: never fits the 2 free devices
        _o(3, 1, 20, 200, 250),   # waits 20..200: fits the 2 free ones until 100, then none free
    ]
    # 20..100: 2 free, the 1-GPU request fits one of them -> 80 device-seconds.
    assert idle_while_waiting(outcomes, 4) == pytest.approx(80.0)


def test_a_job_that_ran_in_pieces_waits_between_them() -> None:
    # A borrowed lease called back at 100 s; the rest of the job ran from 300 s to 400 s.
    pieces = Outcome(1, "u", 1, 0, 0, 400, ((0, 100), (300, 400)))
    assert (pieces.run_s, pieces.wait_s) == (200, 200)
    # One device: free from 100 s to 300 s while the job waited for it (nobody else there).
    assert idle_while_waiting([pieces], 1) == 200
    whole = Outcome(2, "u", 1, 0, 50, 250)
    assert (whole.run_s, whole.wait_s) == (200, 50) and whole.pieces == ((50, 250),)


def test_jain_and_service_rates() -> None:
    assert jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    rates = service_rates([_o(1, 1, 0, 0, 10, "a"), _o(2, 2, 0, 10, 20, "b")])
    assert rates == {"a": pytest.approx(1.0), "b": pytest.approx(0.5)}


def test_figures_of_a_hand_made_run() -> None:
    result = figures([_o(1, 1, 0, 0, 100, "a"), _o(2, 1, 0, 100, 150, "b")], devices=1)
    assert result["jobs"] == 2 and result["makespan_s"] == 150
    assert result["utilization"] == pytest.approx(1.0)
    assert result["wait_max_s"] == 100 and result["idle_while_waiting_s"] == 0
    # b ran 50 of its 150 s in the system, a all of its 100: (1 + 1/3)^2 / (2 (1 + 1/9)) = 0.8
    assert result["jain"] == pytest.approx(0.8)
    # Bounded slowdown: b waited 100 s for a 50 s run, under the 10 min floor it counts 1.
    assert result["per_user"]["b"]["slowdown"] == 1.0


def test_time_limits_are_whole_real_minutes_for_every_system() -> None:
    compression = plan.Compression(180)  # one real minute = 3 lab hours
    job = trace.Job(1, "a", 0, 1, duration_s=5 * 3600, time_limit_s=4 * 3600)
    [vaccel] = plan.steps([job], "vaccel", compression)
    [slurm] = plan.steps([job], "slurm", compression)
    assert vaccel == slurm and vaccel.time_limit_s == 6 * 3600 and vaccel.hold_s == 5 * 3600
    # Without --time: the default (24 h) cuts nothing shorter than a day; under the lab's
    # policy the user states twice the duration, rounded up to the hour, then to the step.
    free = trace.Job(2, "a", 0, 1, duration_s=1800)
    assert plan.steps([free], "vaccel", compression)[0].time_limit_s == 0
    assert plan.steps([free], "vaccel-policy", compression)[0].time_limit_s == 3 * 3600
    assert plan.steps([free], "slurm-policy", compression) == plan.steps([free], "vaccel-policy", compression)
    assert compression.minutes(plan.DEFAULT_LIMIT_S) == 8


def test_generated_traces_are_reproducible_and_plausible() -> None:
    jobs = trace.generate(seed=7, hours=48)
    assert jobs == trace.generate(seed=7, hours=48) != trace.generate(seed=8, hours=48)
    assert {j.gpus for j in jobs} <= {1, 2, 4} and {j.kind for j in jobs} == set(trace.KINDS)
    assert all(trace.SHORTEST_S <= j.duration_s <= trace.LONGEST_S for j in jobs if j.kind == trace.BATCH)
    assert 0 < sum(1 for j in jobs if j.time_limit_s) < len(jobs)
    assert trace.parse(trace.to_jsonl(jobs)) == jobs


def test_a_bad_trace_is_one_line_and_status_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("user,submit_s,gpus,duration_s\nann,0,0,60\n")
    done = _bench("--trace", str(bad), "--systems", "vaccel")
    assert done.returncode == 2
    assert done.stderr.strip() == f"bench.lab: {bad}: row 1: gpus must be >= 1, duration_s > 0, " \
                                  "submit_s and time_limit_s >= 0"


def _bench(*args: str, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VACCEL_SOCKET", "VACCEL_LEASE_ID")}
    if tmp is not None:  # the run's temp dirs go there (tempfile follows TMPDIR), nobody else's
        env["TMPDIR"] = str(tmp)
    return subprocess.run([sys.executable, "-m", "bench.lab", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=150)


def _replay(tmp_path: Path, systems: str) -> dict:
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(job) + "\n" for job in TINY))
    # A folder of this run's own, short (socket paths), so another run's temp dirs never count.
    tmp = Path(tempfile.mkdtemp(prefix="vbl-", dir="/tmp"))
    tmp.chmod(0o1777)  # as /tmp itself: the lab users' jobs reach the broker's socket through it
    try:
        done = _bench("--trace", str(path), "--devices", "2", "--speed", "1200", "--systems", systems, "--json",
                      tmp=tmp)
        assert done.returncode == 0, done.stderr
        assert list(tmp.iterdir()) == [], "the run left its temp dir behind"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return json.loads(done.stdout)


def _check_sane(system: dict, jobs: int) -> None:
    assert FIGURES <= set(system)
    assert system["jobs"] == jobs
    assert 0 < system["utilization"] <= 1
    assert system["idle_while_waiting_s"] >= 0
    assert 0 <= system["wait_p50_s"] <= system["wait_p90_s"] <= system["wait_max_s"]
    assert 0 < system["jain"] <= 1
    assert system["makespan_s"] >= max(j["submit_s"] for j in TINY)
    assert set(system["per_user"]) == {j["user"] for j in TINY}


@pytest.mark.timeout(180)
def test_tiny_trace_against_vaccel(tmp_path: Path) -> None:
    result = _replay(tmp_path, "vaccel,vaccel-policy")
    assert result["trace"]["jobs"] == len(TINY) and result["devices"] == 2
    assert set(result["systems"]) == {"vaccel", "vaccel-policy"} and result["ratios"] == {}
    for system in result["systems"].values():
        _check_sane(system, len(TINY))
    # Every job held its devices for as long as the plan says: its duration, or its time
    # limit rounded to whole real minutes (20 lab hours at 1200x: no job here reaches it).
    jobs = trace.parse("".join(json.dumps(job) + "\n" for job in TINY))
    held = sum(s.job.gpus * s.hold_s for s in plan.steps(jobs, "vaccel", plan.Compression(1200))) / 3600
    assert held == sum(j["gpus"] * j["duration_s"] for j in TINY) / 3600
    assert result["systems"]["vaccel"]["device_hours"] == pytest.approx(held, rel=0.05)


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0 or bool(missing_programs()),
                    reason="SLURM LAB BENCH SKIPPED: needs root and slurm-wlm (scripts/setup.sh)")
def test_tiny_trace_against_slurm_gives_ratios(tmp_path: Path) -> None:
    result = _replay(tmp_path, "vaccel,slurm")
    for system in result["systems"].values():
        _check_sane(system, len(TINY))
    assert set(result["ratios"]) == {"vaccel"}
    assert result["ratios"]["vaccel"]["utilization"] > 0


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0 or bool(missing_programs()) or bool(accounting_missing()),
                    reason="SLURM-FS LAB BENCH SKIPPED: needs root, slurm-wlm, slurmdbd and mariadb-server "
                           "(scripts/setup.sh)")
def test_tiny_trace_against_slurm_with_fair_share_is_the_reference(tmp_path: Path) -> None:
    result = _replay(tmp_path, "vaccel,slurm-fs")
    for system in result["systems"].values():
        _check_sane(system, len(TINY))
    # The comparison of record: ratios against Slurm with fair share.
    assert result["reference"] == "slurm-fs" and set(result["ratios"]) == {"vaccel"}
    setup = result["setup"]["slurm-fs"]
    assert "PriorityType=priority/multifactor" in setup["slurm.conf"]
    assert "AccountingStorageType=accounting_storage/slurmdbd" in setup["slurm.conf"]
    assert "bf_continue" in setup["slurm.conf"]  # the same backfill settings as FIFO Slurm's
    # One association per lab user, each charged for its own jobs (they ran under its uid).
    rows = [line.split("|") for line in setup["sshare"][1:]]
    users = {row[1]: row for row in rows if row[1]}
    assert set(users) >= {replay_slurm.unix_name(j["user"]) for j in TINY}, setup["sshare"]
    assert all(row[0].strip() == "lab" for user, row in users.items() if user != "root")


def test_tiny_trace_against_slurm_with_fair_share_and_a_cap_is_like_against_like(tmp_path: Path) -> None:
    result = _replay(tmp_path, "vaccel-policy,slurm-fs-policy")
    for system in result["systems"].values():
        _check_sane(system, len(TINY))
    assert set(result["like"]) == {"vaccel-policy / slurm-fs-policy"}
    # The cap is the QOS's: slurmdbd knows gres/gpu once slurmctld registered it.
    qos = result["setup"]["slurm-fs-policy"]["qos"]
    assert "gres/gpu=" in qos, qos


SACCT = """JobID|User|JobName|Submit|Start|End|Timelimit|AllocTRES
101|ann|train|2025-03-03T09:00:00|2025-03-03T09:00:05|2025-03-03T10:00:05|1-00:00:00|billing=1,cpu=1,gres/gpu=1,node=1
102|bob|interactive|2025-03-03T09:10:00|2025-03-03T09:20:00|2025-03-03T11:20:00|04:00:00|cpu=1,gres/gpu:a100=2,node=1
103|cat|prep|2025-03-03T09:15:00|2025-03-03T09:15:01|2025-03-03T09:30:01|01:00:00|cpu=4,node=1
104|dan|big|2025-03-03T09:20:00|Unknown|Unknown|1-00:00:00|
"""


def test_sacct_converts_to_a_trace_the_bench_reads(tmp_path: Path) -> None:
    from bench.lab.convert import from_sacct, slurm_duration

    jobs, skipped = from_sacct(SACCT, default_time_s=slurm_duration("1-00:00:00"))
    assert skipped == 2  # a CPU-only job, and one that never started
    assert jobs == [trace.Job(1, "ann", 0, 1, 3600, 0.0, trace.BATCH),  # the partition's default: no --time
                    trace.Job(2, "bob", 600, 2, 7200, 4 * 3600, trace.INTERACTIVE)]
    path = tmp_path / "week.sacct"
    path.write_text(SACCT)
    done = subprocess.run([sys.executable, "-m", "bench.lab.convert", "sacct", str(path), "--default-time",
                           "1-00:00:00"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert trace.parse(done.stdout) == jobs and "left out 2 job(s)" in done.stderr


def test_a_vaccel_lease_report_converts_to_a_trace() -> None:
    from bench.lab.convert import from_vaccel

    csv_text = ("key,user,requested_at,granted_at,ended_at,devices,time_limit_s,reservation,state,device_hours,wait_s\n"
                "l-1,ann,1000.0,1000.5,4600.5,1,86400.0,0,released,1.0,0.5\n"
                "l-2,bob,1300.0,1900.0,2500.0,2,3600.0,1,released,0.33,600\n")
    jobs, skipped = from_vaccel(csv_text, default_time_s=86400.0)
    assert skipped == 0
    assert jobs == [trace.Job(1, "ann", 0, 1, 3600, 0.0, trace.BATCH),
                    trace.Job(2, "bob", 300, 2, 600, 3600.0, trace.INTERACTIVE)]
