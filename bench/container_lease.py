"""How fast a lease follows its container (issue 34), beside a bare `docker run` in the same run:
part of `python -m bench.containers`, against its private dockerd and a broker told to ask it.

Each round, on the lab server's devices (one device per figure, so the rounds do not wait on
each other), times taken from the broker's own grant times and the container's own clock:
- bare start: spawning `docker run --rm IMAGE date` until the command inside prints the time;
- lease to start: the grant of `vaccel run --device gpuN -- docker run --rm IMAGE date`
  until the command inside prints the time;
- exit to next grant: the last word of a leased container (printed as it exits) until the
  grant to the request waiting for its device;
- SIGKILL of a foreground `vaccel run -- docker run ... sleep`: until the container is gone
  (`docker wait` returns), and until the request waiting for its device is granted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import IO, Any

from bench.stats import summary_ms
from tests.conftest import Broker
from tests.container_engine import DOCKER, IMAGE, DockerEngine

PRINT_TIME = ["date", "+%s.%N"]
FIGURES = {
    "bare_start": "bare docker run: spawn to its command's start",
    "grant_to_start": "vaccel run -- docker run: grant to command start",
    "exit_to_next_grant": "leased container's exit to the next grant",
    "kill_to_stopped": "SIGKILL of vaccel run to its container gone",
    "kill_to_next_grant": "SIGKILL of vaccel run to the next grant",
}


def _leased(broker: Broker, engine: DockerEngine, device: str, *command: str, name: str = "") -> list[str]:
    named = ["--name", name] if name else []
    return [sys.executable, "-m", "vaccel.cli", "run", "--device", device, "--", DOCKER, "run", "--rm", *named,
            *engine.image_args(), IMAGE, *command]


def _lease_of(stderr: str) -> str:
    found = re.search(r"vaccel: lease (l-[\w-]+)", stderr)
    if not found:
        raise RuntimeError(f"no lease in {stderr!r}")
    return found.group(1)


def _lease_read(stream: IO[str]) -> str:
    """The lease id `vaccel run` announces on `stream`, after its lines while it waits."""
    seen = ""
    for line in stream:
        seen += line
        if re.search(r"vaccel: lease l-", line):
            return _lease_of(line)
    raise RuntimeError(f"no lease in {seen!r}")


def _granted_at(broker: Broker, lease_id: str) -> float:
    leases = json.loads(broker.vaccel("leases", "--ended", "--json").stdout)["leases"]
    return next(lease["granted_at"] for lease in leases if lease["id"] == lease_id)


def _until(predicate: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("the bench waited in vain")
        time.sleep(0.01)


def _waiting(broker: Broker) -> int:
    return len(json.loads(broker.vaccel("status", "--json").stdout)["queue"])


def _named(broker: Broker, lease_id: str) -> bool:
    devices = json.loads(broker.vaccel("status", "--json").stdout)["devices"]
    return any(d["lease_id"] == lease_id and d["holder"]["container"] for d in devices)


def one_round(broker: Broker, engine: DockerEngine, env: dict[str, str], round_: int) -> dict[str, float]:
    times: dict[str, float] = {}
    spawned = time.time()
    bare = subprocess.run([DOCKER, "run", "--rm", *engine.image_args(), IMAGE, *PRINT_TIME], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    times["bare_start"] = float(bare.stdout) - spawned

    leased = subprocess.run(_leased(broker, engine, "gpu0", *PRINT_TIME), env=env, capture_output=True, text=True,
                            timeout=120, check=True)
    times["grant_to_start"] = float(leased.stdout) - _granted_at(broker, _lease_of(leased.stderr))

    first = subprocess.Popen(_leased(broker, engine, "gpu1", "sh", "-c", "sleep 2; date +%s.%N"), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _lease_read(first.stderr)
    second = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--device", "gpu1", "--", "true"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _until(lambda: _waiting(broker) == 1)
    exited = float(first.communicate(timeout=120)[0])
    next_lease = _lease_read(second.stderr)
    second.wait(60)
    times["exit_to_next_grant"] = _granted_at(broker, next_lease) - exited

    name = f"bench-killed-{round_}"
    killed = subprocess.Popen(_leased(broker, engine, "gpu2", "sleep", "600", name=name), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    held = _lease_read(killed.stderr)
    _until(lambda: _named(broker, held))
    waiter = subprocess.Popen([sys.executable, "-m", "vaccel.cli", "run", "--device", "gpu2", "--", "true"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _until(lambda: _waiting(broker) == 1)
    gone = subprocess.Popen([DOCKER, "wait", name], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.2)  # `docker wait` is attached before the kill
    at = time.time()
    killed.kill()
    killed.wait(30)
    gone.wait(60)
    times["kill_to_stopped"] = time.time() - at
    next_lease = _lease_read(waiter.stderr)
    waiter.wait(60)
    times["kill_to_next_grant"] = _granted_at(broker, next_lease) - at
    return times


def measure(broker: Broker, engine: DockerEngine, runs: int) -> dict[str, dict[str, float]]:
    """Each figure's summary over `runs` rounds (after one to warm up)."""
    env = {**broker.env, "DOCKER_HOST": engine.host}
    samples: dict[str, list[float]] = {key: [] for key in FIGURES}
    for round_ in range(runs + 1):
        times = one_round(broker, engine, env, round_)
        if round_:
            for key, value in times.items():
                samples[key].append(value)
    return {key: summary_ms(values) for key, values in samples.items()}


def broker_config(engine: DockerEngine, stop_grace_s: int) -> str:
    return f'[containers]\ndocker = "{engine.host}"\nstop_grace = "{stop_grace_s}s"\n'
