"""Containers on this machine: how long the test bed takes to come up, and what `vaccel run`
adds to a container's start (issue 34).

    python -m bench.containers                # needs root and scripts/setup.sh's engines
    python -m bench.containers --runs 20 --rootless --json

Prints, each a median with its spread:
- engine start: a private dockerd (tests/container_engine.py) from spawn until it answers,
  over `--starts` start/stop cycles; image: importing the host-/usr test image;
- `docker run --rm IMAGE true`, and the same under `vaccel run --gpus 1 --` against a broker
  on the simulated lab server (the lease, the rewritten command, the release), interleaved
  round by round so a noisy neighbour slows both alike; their ratio and difference;
- with --rootless, `podman run --rm IMAGE true` as an unprivileged user;
- how fast the lease follows its container (bench/container_lease.py): grant to the container's
  command starting, beside a bare docker run's spawn to its command starting; a container's exit
  to the next grant of its device; SIGKILL of a foreground `vaccel run` to its container gone,
  and to the next grant.
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
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import container_lease
from bench.stats import summary_ms
from tests.conftest import LAB_INVENTORY, Broker
from tests.container_engine import DOCKER, DOCKERD, IMAGE, PODMAN, PODMAN_IMAGE, DockerEngine, missing_programs
from tests.podman_engine import RootlessPodman, ensure_rootless_user

BARE = "docker run --rm IMAGE true"
LEASED = "vaccel run --gpus 1 -- docker run --rm IMAGE true"
ROOTLESS = "podman run --rm IMAGE true (rootless)"


def _timed(argv: list[str], env: dict[str, str], run_as: RootlessPodman | None = None) -> float:
    start = time.perf_counter()
    done = run_as.run_as_user(argv, env) if run_as else subprocess.run(argv, env=env, capture_output=True, text=True,
                                                                         timeout=120)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}... exited {done.returncode}: {done.stderr[-500:]}")
    return took


def engine_starts(count: int) -> tuple[list[float], list[float]]:
    """(start seconds, image import seconds) of `count` fresh private dockerds."""
    starts, imports = [], []
    for _ in range(count):
        engine = DockerEngine(Path(tempfile.mkdtemp(prefix="vct-b-", dir="/tmp")))
        try:
            began = time.perf_counter()
            engine.start()
            starts.append(time.perf_counter() - began)
            began = time.perf_counter()
            engine.import_image()
            imports.append(time.perf_counter() - began)
        finally:
            engine.stop()
    return starts, imports


def run(runs: int, starts: int, rootless: bool) -> dict[str, Any]:
    start_s, import_s = engine_starts(starts)
    root = Path(tempfile.mkdtemp(prefix="vaccel-bench-ct-", dir="/tmp"))
    engine = DockerEngine(root / "docker")
    podman: RootlessPodman | None = None
    broker: Broker | None = None
    try:
        (root / "docker").mkdir()
        engine.start()
        engine.import_image()
        (root / "broker").mkdir()
        broker = Broker(root / "broker", LAB_INVENTORY, container_lease.broker_config(engine, 10)).start()
        env = {**broker.env, "DOCKER_HOST": engine.host}
        bare = [DOCKER, "run", "--rm", *engine.image_args(), IMAGE, "true"]
        leased = [sys.executable, "-m", "vaccel.cli", "run", "-q", "--gpus", "1", "--", *bare]
        times: dict[str, list[float]] = {BARE: [], LEASED: []}
        if rootless:
            ensure_rootless_user()
            podman = RootlessPodman(Path(tempfile.mkdtemp(prefix="vct-b-p-", dir="/tmp"))).start()
            podman.import_image()
            times[ROOTLESS] = []
        for round_ in range(runs + 1):  # round 0 warms the page cache, the engine and the broker
            for name, took in ((BARE, _timed(bare, env)), (LEASED, _timed(leased, env))):
                if round_:
                    times[name].append(took)
            if podman is not None:
                took = _timed([PODMAN, "run", "--rm", *podman.image_args(), PODMAN_IMAGE, "true"], podman.env, podman)
                if round_:
                    times[ROOTLESS].append(took)
        following = container_lease.measure(broker, engine, runs)
    finally:
        if broker is not None:
            broker.stop()
        if podman is not None:
            podman.stop()
        engine.stop()
        shutil.rmtree(root, ignore_errors=True)
    figures = {name: summary_ms(values) for name, values in times.items()}
    bare_p50, leased_p50 = figures[BARE]["p50_ms"], figures[LEASED]["p50_ms"]
    return {"runs": runs, "cpus": os.cpu_count(), "engine_start": summary_ms(start_s),
            "image_import": summary_ms(import_s), "figures": figures, "lease_follows_container": following,
            "leased_minus_bare_ms": leased_p50 - bare_p50, "leased_x_bare": leased_p50 / bare_p50 if bare_p50 else 0.0}


def render(result: dict[str, Any]) -> str:
    lines = [f"containers on {result['cpus']} CPU(s), Debian's docker.io (private dockerd, overlay2, cgroupfs)", ""]
    for label, key in (("engine start (spawn to answer)", "engine_start"),
                       ("image import (host /usr)", "image_import")):
        row = result[key]
        lines.append(f"{label:<52}{row['p50_ms']:>9.1f} ms  (n={row['n']}, {row['min_ms']:.1f}-{row['max_ms']:.1f})")
    lines += ["", f"{'command, ' + str(result['runs']) + ' runs each, interleaved':<52}{'p50 ms':>9}{'p90 ms':>9}"
              f"{'min ms':>9}{'max ms':>9}"]
    for name, row in result["figures"].items():
        lines.append(f"{name:<52}{row['p50_ms']:>9.1f}{row['p90_ms']:>9.1f}{row['min_ms']:>9.1f}{row['max_ms']:>9.1f}")
    lines += ["", f"vaccel run adds {result['leased_minus_bare_ms']:.1f} ms to a container's start-to-exit "
              f"({result['leased_x_bare']:.2f}x the bare docker run)"]
    lines += ["", f"{'the lease follows its container, ' + str(result['runs']) + ' rounds':<52}{'p50 ms':>9}"
              f"{'p90 ms':>9}{'min ms':>9}{'max ms':>9}"]
    for key, label in container_lease.FIGURES.items():
        row = result["lease_follows_container"][key]
        lines.append(f"{label:<52}{row['p50_ms']:>9.1f}{row['p90_ms']:>9.1f}{row['min_ms']:>9.1f}{row['max_ms']:>9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.containers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="runs of each command (default 10)")
    parser.add_argument("--starts", type=int, default=3, help="engine start/stop cycles timed (default 3)")
    parser.add_argument("--rootless", action="store_true", help="also time rootless podman")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    missing = missing_programs(DOCKERD, DOCKER, *([PODMAN] if args.rootless else []))
    if os.geteuid() != 0 or missing:
        print(f"bench.containers: needs root and {', '.join(missing) or 'the engines'} (scripts/setup.sh)",
              file=sys.stderr)
        return 2
    result = run(args.runs, args.starts, args.rootless)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
