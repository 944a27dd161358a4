"""Containers after their lease (issue 42): how fast the broker stops a container that starts
outside a live lease, and what following the engine's events costs it.

    python -m bench.container_restarts            # needs root and scripts/setup.sh's docker.io
    python -m bench.container_restarts --runs 20 --idle 60 --json

Against a private dockerd (tests/container_engine.py) and a broker on the simulated lab server
told to ask it (`[containers] docker`, stop_grace 10s):
- the next-morning start: a container made under `vaccel run --device gpu0 -- docker run -d`,
  its lease ended (`docker stop`), then `docker start`ed again, `--runs` times. Figures: the
  engine's own StartedAt to FinishedAt (how long it ran before the broker stopped it), and
  `docker start` called until `docker wait` returns (what a student sees);
- the event path's cost: the broker's CPU time (utime+stime from /proc) over `--idle` seconds
  with nothing happening (beside the same broker following no engine), and per start event
  of a container the broker lets run (a plain `docker run --rm IMAGE true`: start, judged,
  let be), net of an idle period as long.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.stats import summary_ms
from tests.conftest import LAB_INVENTORY, Broker
from tests.container_engine import DOCKER, DOCKERD, IMAGE, DockerEngine, missing_programs

CONFIG = '[containers]\ndocker = "{host}"\nstop_grace = "10s"\n'


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_time(text: str) -> float:
    # RFC 3339 with nanoseconds: keep microseconds for datetime
    head, _, frac = text.strip().rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp()


def next_morning(broker: Broker, engine: DockerEngine, runs: int) -> dict[str, Any]:
    env = {**broker.env, "DOCKER_HOST": engine.host}
    r = subprocess.run([sys.executable, "-m", "vaccel.cli", "run", "-q", "--device", "gpu0", "--", DOCKER, "run",
                        "-d", "--name", "bench-nb", *engine.image_args(), IMAGE, "sleep", "600"], env=env,
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    engine.docker("stop", "bench-nb", check=True)
    ran, seen = [], []
    try:
        for _ in range(runs):
            began = time.perf_counter()
            engine.docker("start", "bench-nb", check=True)
            engine.docker("wait", "bench-nb", check=True, timeout=120)
            seen.append(time.perf_counter() - began)
            started, finished = (_engine_time(engine.inspect("bench-nb", f"{{{{.State.{key}}}}}"))
                                 for key in ("StartedAt", "FinishedAt"))
            ran.append(finished - started)
    finally:
        engine.docker("rm", "-f", "bench-nb")
    return {"ran_before_stopped": summary_ms(ran), "start_call_to_stopped": summary_ms(seen)}


def idle_cpu_s(broker: Broker, idle_s: float) -> float:
    assert broker.proc is not None
    time.sleep(2.0)  # let the start settle
    before = cpu_s(broker.proc.pid)
    time.sleep(idle_s)
    return cpu_s(broker.proc.pid) - before


def event_cost(broker: Broker, engine: DockerEngine, idle_s: float, events: int) -> dict[str, Any]:
    assert broker.proc is not None
    pid = broker.proc.pid
    idle = idle_cpu_s(broker, idle_s)
    began, before = time.perf_counter(), cpu_s(pid)
    for _ in range(events):
        engine.docker("run", "--rm", *engine.image_args(), IMAGE, "true", check=True)
    time.sleep(1.0)  # the last judgement
    took = time.perf_counter() - began
    busy = cpu_s(pid) - before - idle * took / idle_s
    return {"idle_s": idle_s, "idle_cpu_s": idle, "idle_cpu_percent": 100 * idle / idle_s, "events": events,
            "cpu_ms_per_event": 1000 * busy / events}


def run(runs: int, idle_s: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="vaccel-bench-cr-", dir="/tmp"))
    engine = DockerEngine(root / "docker")
    broker: Broker | None = None
    try:
        (root / "docker").mkdir()
        engine.start()
        engine.import_image()
        (root / "broker").mkdir()
        (root / "plain").mkdir()
        plain = Broker(root / "plain", LAB_INVENTORY, "").start()  # the same broker, following no engine
        try:
            baseline = idle_cpu_s(plain, idle_s)
        finally:
            plain.stop()
        broker = Broker(root / "broker", LAB_INVENTORY, CONFIG.format(host=engine.host)).start()
        cost = {**event_cost(broker, engine, idle_s, runs), "idle_cpu_s_following_none": baseline}
        figures = next_morning(broker, engine, runs)
    finally:
        if broker is not None:
            broker.stop()
        engine.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"runs": runs, "cpus": os.cpu_count(), **figures, "event_path": cost}


def render(result: dict[str, Any]) -> str:
    lines = [f"containers after their lease, {result['runs']} runs, {result['cpus']} CPU(s)",
             f"{'':<52}{'p50 ms':>9}{'p90 ms':>9}{'min ms':>9}{'max ms':>9}"]
    for key, label in (("ran_before_stopped", "next-morning start: ran before stopped (engine)"),
                       ("start_call_to_stopped", "docker start called to docker wait returned")):
        row = result[key]
        lines.append(f"{label:<52}{row['p50_ms']:>9.1f}{row['p90_ms']:>9.1f}{row['min_ms']:>9.1f}{row['max_ms']:>9.1f}")
    cost = result["event_path"]
    lines += [f"idle broker following dockerd: {cost['idle_cpu_s'] * 1000:.0f} ms CPU in {cost['idle_s']:g} s "
              f"({cost['idle_cpu_percent']:.3f}%); following no engine: "
              f"{cost['idle_cpu_s_following_none'] * 1000:.0f} ms",
              f"per start event of a container let run: {cost['cpu_ms_per_event']:.2f} ms CPU "
              f"(n={cost['events']})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.container_restarts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="next-morning starts, and start events (default 10)")
    parser.add_argument("--idle", type=float, default=30.0, help="idle seconds measured (default 30)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    missing = missing_programs(DOCKERD, DOCKER)
    if os.geteuid() != 0 or missing:
        print(f"bench.container_restarts: needs root and {', '.join(missing) or 'docker.io'} (scripts/setup.sh)",
              file=sys.stderr)
        return 2
    result = run(args.runs, args.idle)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
