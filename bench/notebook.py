"""Notebook benchmark: the vaccel kernel behind a real Jupyter server (jupyter_server, driven
through its REST API as JupyterLab drives it) and a real daemon on 4 simulated devices.

    python -m bench.notebook                        # 10 starts, 2 revokes watched 60 s each (~3 min)
    python -m bench.notebook --starts 3 --ends 1 --watch 10    # a smoke run
    python -m bench.notebook --json

- kernel start -> lease: POST /api/kernels, which answers once the kernel holds its lease
  (the devices are free), then the first cell's answer (IPython up); beside them, what a
  bare `python -c "import torch"` costs on this machine (the kernel used to wait for it
  before asking for its lease: it reported torch's build to the broker).
- lease end -> kernel stopped: `vaccel release ID` as root (an admin's revoke) has returned
  -> the kernel process is gone (polled every 10 ms). The daemon runs its default
  heartbeat TTL (30 s: a holder beats every 5 s at most, so it hears of the end within a
  beat). Then Jupyter's own restarter (it polls every 3 s) brings back a kernel without a
  lease: the time until a cell answers LeaseEnded; and for --watch seconds the broker's
  status is polled every 0.5 s: every lease and queue entry seen is counted (must be 0).

Figures are printed, never asserted. Clocks: time.monotonic() in this process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.leases import BenchError, print_outcome
from bench.stats import summary_ms
from tests.conftest import LAB_INVENTORY, Broker
from tests.jupyter_server import JupyterServer

CONFIG = '[leases]\nheartbeat_ttl = "30s"\n'  # the shipped default, stated


def _status(broker: Broker) -> dict[str, Any]:
    import json

    r = broker.vaccel("status", "--json")
    if r.returncode != 0:
        raise BenchError(f"vaccel status failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def _wait(predicate: Any, timeout: float, what: str, pause: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(pause)
    raise BenchError(f"{what}: not within {timeout:.0f} s")


def _pid_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except (OSError, IndexError):
        return True


def measure_starts(server: JupyterServer, broker: Broker, count: int) -> dict[str, list[float]]:
    leased, ready = [], []
    for _ in range(count):
        start = time.monotonic()
        reply = server.api("POST", "/api/kernels", {"name": "vaccel-1gpu"})
        took = time.monotonic() - start
        if reply.status != 201:
            raise BenchError(f"POST /api/kernels: {reply.status} {reply.body}")
        kernel_id = reply.body["id"]
        if not any(d["lease_id"] for d in _status(broker)["devices"]):
            raise BenchError("the kernel's start ended without a lease")
        cell = server.execute(kernel_id, "1")
        ready.append(time.monotonic() - start)
        leased.append(took)
        if cell.status != "ok":
            raise BenchError(f"the first cell failed: {cell}")
        server.api("DELETE", f"/api/kernels/{kernel_id}")
        _wait(lambda: not any(d["lease_id"] for d in _status(broker)["devices"]), 30, "the device freed")
    return {"start_to_lease": leased, "start_to_first_cell": ready}


def measure_ends(server: JupyterServer, broker: Broker, count: int, watch_s: float) -> dict[str, Any]:
    stopped, restarted, seen = [], [], 0
    for _ in range(count):
        kernel_id = server.api("POST", "/api/kernels", {"name": "vaccel-1gpu"}).body["id"]
        (held,) = [d for d in _status(broker)["devices"] if d["lease_id"]]
        pid = held["holder"]["pid"]
        r = broker.vaccel("release", held["lease_id"])
        ended = time.monotonic()
        if r.returncode != 0:
            raise BenchError(f"vaccel release: {r.stderr.strip()}")
        _wait(lambda: _pid_gone(pid), 60, "the kernel stopping")  # noqa: B023 - used at once
        stopped.append(time.monotonic() - ended)
        _wait(lambda: _answers_lease_ended(server, kernel_id), 60, "the restarted kernel's answer",  # noqa: B023
              pause=0.2)
        restarted.append(time.monotonic() - ended)
        deadline = ended + watch_s
        while time.monotonic() < deadline:
            now = _status(broker)
            seen += sum(1 for d in now["devices"] if d["lease_id"]) + len(now["queue"])
            time.sleep(0.5)
        server.api("DELETE", f"/api/kernels/{kernel_id}")
    return {"end_to_kernel_stopped": stopped, "end_to_restarted_without_lease": restarted,
            "leases_or_waits_seen_after_the_end": seen, "watched_s": watch_s, "ends": count}


def _answers_lease_ended(server: JupyterServer, kernel_id: str) -> bool:
    try:
        cell = server.execute(kernel_id, "1", timeout=10)
    except TimeoutError:
        return False
    return cell.error is not None and cell.error.get("ename") == "LeaseEnded"


def _import_torch_s(runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
        times.append(time.monotonic() - start)
    return times


def run(starts: int, ends: int, watch_s: float) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-bench-", dir="/tmp"))
    broker = server = None
    try:
        (workdir / "broker").mkdir()
        broker = Broker(workdir / "broker", LAB_INVENTORY, CONFIG).start()
        env = {**broker.env, "JUPYTER_DATA_DIR": str(workdir / "data"), "JUPYTER_RUNTIME_DIR": str(workdir / "rt")}
        r = broker.vaccel("kernel", "install", "--user", env=env)
        if r.returncode != 0:
            raise BenchError(f"vaccel kernel install: {r.stderr.strip()}")
        server = JupyterServer(workdir, env).start()
        measure_starts(server, broker, 1)  # warm the page cache
        result: dict[str, Any] = {"cpus": os.cpu_count()}
        result.update({name: summary_ms(values) for name, values in measure_starts(server, broker, starts).items()})
        result["python_import_torch"] = summary_ms(_import_torch_s(max(3, starts // 2)))
        if ends:
            end = measure_ends(server, broker, ends, watch_s)
            result.update({name: summary_ms(end.pop(name)) for name in
                           ("end_to_kernel_stopped", "end_to_restarted_without_lease")})
            result.update(end)
        return result
    finally:
        if server is not None:
            server.stop()
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def render(result: dict[str, Any]) -> str:
    lines = [f"the vaccel kernel behind jupyter_server, 4 simulated devices, {result['cpus']} CPU(s)", "",
             f"{'figure':<42}{'n':>4}{'p50 ms':>10}{'p90 ms':>10}{'min ms':>10}{'max ms':>10}"]
    for name in ("start_to_lease", "start_to_first_cell", "python_import_torch", "end_to_kernel_stopped",
                 "end_to_restarted_without_lease"):
        row = result.get(name)
        if row:
            lines.append(f"{name.replace('_', ' '):<42}{row['n']:>4}{row['p50_ms']:>10.0f}{row['p90_ms']:>10.0f}"
                         f"{row['min_ms']:>10.0f}{row['max_ms']:>10.0f}")
    if "ends" in result:
        lines += ["", f"after {result['ends']} revoke(s), watched {result['watched_s']:.0f} s each: "
                      f"{result['leases_or_waits_seen_after_the_end']} lease(s) or queue entries seen (0 expected)"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.notebook", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=10, help="kernel starts to time (default 10)")
    parser.add_argument("--ends", type=int, default=2, help="revokes to time and watch (default 2; 0: none)")
    parser.add_argument("--watch", type=float, default=60.0, help="seconds to watch after each revoke (default 60)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.starts < 1 or args.ends < 0 or args.watch < 0:
        print("bench: --starts must be at least 1, --ends and --watch not negative", file=sys.stderr)
        return 2
    return print_outcome(lambda: run(args.starts, args.ends, args.watch), render, args.json)


if __name__ == "__main__":
    sys.exit(main())
