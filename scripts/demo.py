"""The main job: a broker on a simulated 4-GPU lab server, with several students' training
scripts contending for its GPUs, so a newcomer sees leasing, queueing and hand-over.

    python scripts/demo.py            # about a minute on a 2-core machine
    python scripts/demo.py --quick    # fewer epochs

Everything is real except the devices: a real vaccel-brokerd on a real Unix socket, real
`vaccel run` clients, real torch training (on the CPU, since the GPUs are simulated).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INVENTORY = ROOT / "examples" / "lab-server.yaml"
CONFIG = """
[leases]
heartbeat_ttl = "10s"
[probe]
refresh_interval = "5s"
"""


@dataclass
class Job:
    """One student's command. `start` is seconds after the broker came up."""

    name: str
    start: float
    args: list[str]
    command: list[str]
    submitted: float = 0.0
    granted: float = 0.0
    finished: float = 0.0
    exit_code: int | None = None
    pid: int = 0
    result: str = ""
    lines: list[str] = field(default_factory=list)


def jobs(epochs: int) -> list[Job]:
    py = sys.executable
    train = [py, str(ROOT / "examples" / "train.py"), "--epochs", str(epochs)]
    ddp = [py, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(ROOT / "examples" / "train_ddp.py"),
           "--epochs", str(epochs)]
    return [
        Job("alice", 0.0, ["--gpus", "2"], ddp),
        Job("bob", 0.5, ["--gpus", "1"], [*train, "--seed", "1"]),
        Job("carol", 1.0, ["--gpus", "1", "--min-memory", "60GiB"], [*train, "--seed", "2"]),
        Job("dave", 1.5, ["--gpus", "2"], [*train, "--seed", "3"]),
        Job("erin", 2.0, ["--gpus", "1"], [*train, "--seed", "4"]),
        Job("frank", 3.0, ["--gpus", "1", "--no-wait"], [*train, "--seed", "5"]),
        Job("grace", 3.5, ["--gpus", "8"], [*train, "--seed", "6"]),
    ]


def say(t0: float, who: str, text: str) -> None:
    print(f"{time.monotonic() - t0:6.1f}s  {who:<7} {text}", flush=True)


def run_job(job: Job, env: dict[str, str], t0: float) -> None:
    time.sleep(job.start)
    job.submitted = time.monotonic()
    cmd = [sys.executable, "-m", "vaccel.cli", "run", *job.args, "--", *job.command]
    say(t0, job.name, f"$ vaccel run {' '.join(job.args)} -- {' '.join(Path(c).name for c in job.command[1:4])} ...")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    job.pid = proc.pid
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        job.lines.append(line)
        if line.startswith("vaccel: lease") and ": gpu" in line and not job.granted:
            job.granted = time.monotonic()
            say(t0, job.name, line.removeprefix("vaccel: "))
        elif line.startswith("vaccel: waiting"):
            say(t0, job.name, line.removeprefix("vaccel: "))
        elif line.startswith("vaccel:") and "warning" not in line:
            say(t0, job.name, line.removeprefix("vaccel: "))
        elif "loss" in line and "->" in line:
            job.result = line.split(";")[-1].strip()
    job.exit_code = proc.wait()
    job.finished = time.monotonic()
    say(t0, job.name, f"exit {job.exit_code}" + (f" ({job.result})" if job.result else ""))


def board(env: dict[str, str], t0: float, all_jobs: list[Job]) -> None:
    r = subprocess.run([sys.executable, "-m", "vaccel.cli", "status", "--json"], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        return
    data = json.loads(r.stdout)
    # Everyone is the same Unix user here: name the holders by job.
    names = {j.pid: j.name for j in all_jobs}
    cells = []
    for d in data["devices"]:
        holder = names.get(d["holder"]["pid"], f"pid {d['holder']['pid']}") if d["holder"] else d["state"]
        cells.append(f"gpu{d['index']}({d['name'].split()[-1]})={holder}")
    queue = ", ".join(names.get(q["requester"]["pid"], "?") for q in data["queue"]) or "empty"
    say(t0, "status", "  ".join(cells) + f"  | queue: {queue}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs per job")
    parser.add_argument("--keep", action="store_true", help="keep the broker's work dir (log, state)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-demo-"))
    (workdir / "brokerd.toml").write_text(CONFIG)
    sock = workdir / "brokerd.sock"
    env = {**os.environ, "VACCEL_SOCKET": str(sock), "PYTHONUNBUFFERED": "1"}
    env.pop("VACCEL_LEASE_ID", None)
    log = (workdir / "brokerd.log").open("w")
    broker = subprocess.Popen([sys.executable, "-m", "brokerd.main", "--config", str(workdir / "brokerd.toml"),
                               "--socket", str(sock), "--state-dir", str(workdir / "state"),
                               "--inventory", str(INVENTORY)], env=env, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    try:
        while not Path(f"{sock}.id").exists():
            if broker.poll() is not None:
                print((workdir / "brokerd.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.05)
        print(f"vaccel demo: broker up on {sock} with the simulated lab server {INVENTORY.name}")
        subprocess.run([sys.executable, "-m", "vaccel.cli", "status"], env=env)
        print()
        all_jobs = jobs(2 if args.quick else 4)
        threads = [threading.Thread(target=run_job, args=(j, env, t0)) for j in all_jobs]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            board(env, t0, all_jobs)
            time.sleep(2.0)
        for t in threads:
            t.join()
        print("\nsummary")
        print(f"  {'job':<7} {'asked':<30} {'waited':>7} {'ran':>6}  exit  result")
        for j in all_jobs:
            waited = f"{j.granted - j.submitted:.1f}s" if j.granted else "-"
            ran = f"{j.finished - j.granted:.1f}s" if j.granted else "-"
            result = j.result or (j.lines[-1].removeprefix("vaccel: ") if j.lines else "")
            print(f"  {j.name:<7} {' '.join(j.args):<30} {waited:>7} {ran:>6}  {j.exit_code!s:>4}  {result}")
        print("\nbroker log (grants and releases):")
        for line in (workdir / "brokerd.log").read_text().splitlines():
            if " grant " in line or " released " in line or " refuse " in line:
                print("  " + line.split(": ", 1)[-1])
        trained = [j for j in all_jobs if j.result]
        expected_refusals = {"frank", "grace"}
        ok = len(trained) == len(all_jobs) - len(expected_refusals) and all(
            j.exit_code != 0 for j in all_jobs if j.name in expected_refusals)
        print("\ndemo " + ("finished: every job that could run trained, the impossible ones were refused at once"
                           if ok else "FAILED: see the job output above"))
        if not ok:
            for j in all_jobs:
                print(f"--- {j.name}\n" + "\n".join(j.lines[-15:]))
        return 0 if ok else 1
    finally:
        broker.terminate()
        broker.wait(10)
        log.close()
        if args.keep:
            print(f"broker work dir kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
