"""What `vaccel run` adds to a short container, and where it goes (issue 45, item 4):

    python -m bench.container_overhead                      # 20 rounds; needs root and docker.io
    python -m bench.container_overhead --baseline /tmp/old  # the same commands from another checkout too
    python -m bench.container_overhead --breakdown          # and one traced run, phase by phase

Against a private dockerd (tests/container_engine.py) and a real broker told to ask it
(`[containers] docker = ...`, as bench/container_lease.py), whole processes, interleaved round
by round so a noisy neighbour slows all alike:
- `docker run --rm IMAGE true`, bare;
- `vaccel run --gpus 1 -- docker run --rm IMAGE true`, and the same with `-q`: the grant, the
  rewritten command, the broker confirming the container with the engine before the lease
  follows it, the release;
- the command `vaccel run` gives the engine (its devices, variables, labels, the broker's
  folder mounted, --init, a --cidfile), bare: run by the bench under a lease the bench holds,
  so that what the container's extra options cost is told apart from what vaccel's process costs;
- with --baseline TREE, the `-q` run from that checkout (its client and shared code first on
  the path, the same interpreter), so that a change is measured against what it changes.
Prints p50 and p90 of each and the ratio of each p50 to the bare run's.

--breakdown traces one more `vaccel run -q` (strace -f, timestamps, the program starts, the
sockets connected, the cidfile looked at, each process's end) and prints its phases from the
first exec: the CLI's start and imports, the grant (a side call on the identity socket), the
engine's client, its connection to the engine, the AttachContainer call (another side call, from
the thread that waits for the cidfile), the engine's client's end, the release and the exit.
Only those calls are stopped at (--seccomp-bpf), so the run is close to an untraced one; and
`python -X importtime` of the same command: what its imports cost.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import container_lease
from bench.startup import vaccel_command
from bench.stats import summary_ms
from tests.conftest import LAB_INVENTORY, Broker
from tests.container_engine import DOCKER, DOCKERD, IMAGE, DockerEngine, missing_programs

BARE = "docker run --rm IMAGE true"
LEASED = "vaccel run --gpus 1 -- docker run ..."
QUIET = "vaccel run -q --gpus 1 -- docker run ..."
REWRITTEN = "docker run --rm [vaccel's options] IMAGE true, bare"
Argv = list[str] | Callable[[], list[str]]


@contextmanager
def rewritten(broker: Broker, bare: list[str], folder: Path) -> Iterator[Callable[[], list[str]]]:
    """The command `vaccel run` would give the engine for `bare`, a fresh --cidfile each call,
    under a lease this process holds (heartbeat on) until the end."""
    from vaccel.containers.argv import for_lease
    from vaccel.containers.engine_command import recognise
    from vaccel.session.lease_session import LeaseRequest, LeaseSession

    run = recognise(bare)
    assert run is not None
    count = iter(range(1 << 30))
    with LeaseSession(broker.socket) as session:
        lease = session.acquire(LeaseRequest(gpus=1, command="bench.container_overhead"))
        session.start_heartbeat()

        def argv() -> list[str]:
            cids = folder / f"cid-{next(count)}"
            cids.mkdir()
            return for_lease(run, lease, str(broker.socket), str(cids))[0]

        try:
            yield argv
        finally:
            session.release()


def commands(engine: DockerEngine, baseline: Path | None,
             rewrite: Callable[[], list[str]]) -> tuple[dict[str, Argv], dict[str, dict[str, str]]]:
    bare = [DOCKER, "run", "--rm", *engine.image_args(), IMAGE, "true"]
    vaccel = vaccel_command()
    cmds: dict[str, Argv] = {BARE: bare, REWRITTEN: rewrite, LEASED: [*vaccel, "run", "--gpus", "1", "--", *bare],
                             QUIET: [*vaccel, "run", "-q", "--gpus", "1", "--", *bare]}
    extra: dict[str, dict[str, str]] = {}
    if baseline is not None:
        name = f"{QUIET} [{baseline.name}]"
        cmds[name] = cmds[QUIET]
        extra[name] = {"PYTHONPATH": f"{baseline / 'client'}{os.pathsep}{baseline}"}
    return cmds, extra


def time_rounds(cmds: dict[str, Argv], extra: dict[str, dict[str, str]], env: dict[str, str],
                runs: int) -> dict[str, list[float]]:
    """Each command `runs` times, round-robin, after one round to warm up; wall seconds, spawn to exit."""
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for round_ in range(runs + 1):
        for name, given in cmds.items():
            argv = given() if callable(given) else given
            start = time.perf_counter()
            done = subprocess.run(argv, env={**env, **extra.get(name, {})}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, timeout=120)
            took = time.perf_counter() - start
            if done.returncode != 0:
                raise RuntimeError(f"{name} exited {done.returncode}: {done.stderr.decode(errors='replace')[-800:]}")
            if round_:
                times[name].append(took)
    return times


# -- the breakdown ---------------------------------------------------------------------

_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+) (.*)$")
_CLONED = re.compile(r"^(?:clone3?\(|<\.\.\. clone3? resumed>).*= (\d+)$")


def trace(argv: list[str], env: dict[str, str], broker_socket: str, engine_socket: str) -> list[tuple[float, str]]:
    """(seconds from the first exec, what happened) of one traced run of `argv`."""
    with tempfile.NamedTemporaryFile(prefix="vaccel-trace-", suffix=".txt", delete=False) as out:
        path = out.name
    try:
        # --seccomp-bpf: the calls not traced run at full speed (an import's many openat among them)
        subprocess.run(["strace", "-f", "--seccomp-bpf", "-ttt", "-qq", "-s", "200", "-o", path, "-e",
                        "trace=execve,connect,exit_group,clone,clone3", *argv],
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=True)
        lines = Path(path).read_text().splitlines()
    finally:
        os.unlink(path)
    return phases(lines, broker_socket, engine_socket)


def phases(lines: list[str], broker_socket: str, engine_socket: str) -> list[tuple[float, str]]:
    """The trace's landmarks, the first of each kind per thread; a thread is named by the
    program its process runs (threads and forks inherit it until their exec)."""
    events: list[tuple[float, str]] = []
    seen: set[tuple[str, str]] = set()
    programs: dict[str, str] = {}
    first = None

    def note(pid: str, at: float, what: str, again: bool = False) -> None:
        if again or (pid, what) not in seen:
            seen.add((pid, what))
            events.append((at - (first or at), f"{programs.get(pid, 'vaccel')}[{pid}]: {what}"))

    for line in lines:
        found = _LINE.match(line)
        if not found:
            continue
        pid, at, call = found.group(1), float(found.group(2)), found.group(3)
        first = at if first is None else first
        cloned = _CLONED.match(call)
        if cloned:
            programs[cloned.group(1)] = programs.get(pid, "vaccel")
        elif call.startswith("execve(") and not re.search(r"= -1 \w+", call):  # the PATH search's misses
            programs[pid] = os.path.basename(call.split('"')[1])
            note(pid, at, f"exec {programs[pid]}")
        elif call.startswith("connect(") and ("= 0" in call or "EINPROGRESS" in call):
            for socket_path, name in ((broker_socket + ".id", "identity socket (a side call)"),
                                      (broker_socket, "broker's gRPC socket"), (engine_socket, "engine socket")):
                if f'"{socket_path}"' in call:
                    note(pid, at, f"connect {name}", again=name.startswith("identity"))  # grant, then release
                    break
        elif call.startswith("exit_group("):
            note(pid, at, "exit")
    return events


def importtime(argv: list[str], env: dict[str, str], top: int = 12) -> list[tuple[float, str]]:
    """The `top` slowest imports (cumulative ms) of one run under `python -X importtime`."""
    python_argv = [sys.executable, "-X", "importtime", "-m", "vaccel.entry", *argv[1:]]
    done = subprocess.run(python_argv, env=env, capture_output=True, text=True, timeout=120, check=True)
    rows = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1000.0, parts[2].rstrip()))
    total = sum(ms for ms, name in rows if not name.startswith(" " * 2))
    return [(total, "(all top-level imports)"), *sorted(rows, reverse=True)[:top]]


# -- the run ---------------------------------------------------------------------------

def run(runs: int, baseline: Path | None, breakdown: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="vaccel-bench-co-", dir="/tmp"))
    engine = DockerEngine(root / "docker")
    broker: Broker | None = None
    result: dict[str, Any] = {"runs": runs, "cpus": os.cpu_count()}
    try:
        (root / "docker").mkdir()
        engine.start()
        engine.import_image()
        (root / "broker").mkdir()
        broker = Broker(root / "broker", LAB_INVENTORY, container_lease.broker_config(engine, 10)).start()
        env = {k: v for k, v in broker.env.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["DOCKER_HOST"] = engine.host
        bare = [DOCKER, "run", "--rm", *engine.image_args(), IMAGE, "true"]
        with rewritten(broker, bare, root) as rewrite:
            cmds, extra = commands(engine, baseline, rewrite)
            times = time_rounds(cmds, extra, env, runs)
        quiet = cmds[QUIET]
        assert isinstance(quiet, list)
        if breakdown:
            result["trace"] = trace(quiet, env, str(broker.socket), str(engine.socket))
            result["importtime"] = importtime(quiet, env)
            for name, more in extra.items():  # the baseline's, the same way
                result["baseline_trace"] = trace(quiet, {**env, **more}, str(broker.socket), str(engine.socket))
                result["baseline_importtime"] = importtime(quiet, {**env, **more})
                result["baseline"] = name
    finally:
        if broker is not None:
            broker.stop()
        engine.stop()
        shutil.rmtree(root, ignore_errors=True)
    figures = {name: summary_ms(values) for name, values in times.items()}
    bare = figures[BARE]["p50_ms"]
    for row in figures.values():
        row["x_bare"] = row["p50_ms"] / bare if bare else 0.0
        row["minus_bare_ms"] = row["p50_ms"] - bare
    result["figures"] = figures
    return result


def render(result: dict[str, Any]) -> str:
    lines = [f"whole processes, {result['runs']} rounds, interleaved, on {result['cpus']} CPU(s); private dockerd "
             "(overlay2, cgroupfs), broker on the simulated lab server asking it", "",
             f"{'command':<58}{'p50 ms':>9}{'p90 ms':>9}{'min ms':>9}{'+ms':>8}{'x bare':>8}"]
    for name, row in result["figures"].items():
        lines.append(f"{name:<58}{row['p50_ms']:>9.1f}{row['p90_ms']:>9.1f}{row['min_ms']:>9.1f}"
                     f"{row['minus_bare_ms']:>8.1f}{row['x_bare']:>7.2f}x")
    for key, whose in (("", "`vaccel run -q`"), ("baseline_", f"`{result.get('baseline', '')}`")):
        if f"{key}trace" not in result:
            continue
        lines += ["", f"one traced {whose} (strace -f --seccomp-bpf: only these calls stop it)",
                  f"{'ms from exec':>12}  {'+ms':>7}  event"]
        last = 0.0
        for at, what in result[f"{key}trace"]:
            lines.append(f"{at * 1000:>12.1f}  {(at - last) * 1000:>7.1f}  {what}")
            last = at
        lines += ["", f"python -X importtime of {whose}: cumulative ms of the slowest imports"]
        lines += [f"{ms:>9.1f}  {name}" for ms, name in result[f"{key}importtime"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.container_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="rounds (default 20)")
    parser.add_argument("--baseline", type=Path, metavar="TREE",
                        help="also time `vaccel run -q` from this checkout (e.g. `git archive main` unpacked)")
    parser.add_argument("--breakdown", action="store_true", help="trace one run and print its phases (needs strace)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    missing = missing_programs(DOCKERD, DOCKER, *(["/usr/bin/strace"] if args.breakdown else []))
    if os.geteuid() != 0 or missing:
        print(f"bench.container_overhead: needs root and {', '.join(missing) or 'the engines'} (scripts/setup.sh)",
              file=sys.stderr)
        return 2
    if args.baseline is not None and not (args.baseline / "client" / "vaccel" / "entry.py").is_file():
        print(f"bench: --baseline {args.baseline}: not a vaccel checkout (no client/vaccel/entry.py)", file=sys.stderr)
        return 2
    result = run(args.runs, args.baseline, args.breakdown)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
