"""Hand-over on a node Slurm allocates: delegate-mode `vaccel run` next to Slurm's own.

    sudo python -m bench.slurm_handover              # 5 pairs of each, about 30 s
    sudo python -m bench.slurm_handover --samples 10 --json

On the single-node test cluster (bench/testbeds/slurm.py: four fake GPUs, Debian's
slurm-wlm, a no-op Epilog so a freed node is scheduled at once), two jobs that each want
all four GPUs are started 0.3 s apart, so the second waits for the first:

- vaccel: `vaccel run --gpus 4 -- bash -c 'echo $EPOCHREALTIME; sleep H; echo $EPOCHREALTIME'`
  against a `[slurm] mode = "delegate"` broker: the holder's command ends -> vaccel run
  releases -> the broker scancels its job -> Slurm starts the waiter's pending job -> its
  salloc returns -> the broker commits the lease -> the waiter's command starts;
- srun: `srun --gres=gpu:4 bash -c '...'`, the same command as plain Slurm jobs.

The figure is the first command's last line -> the second command's first line (bash's
$EPOCHREALTIME on both sides, one wall clock). Printed with the ratio vaccel / srun;
nothing is asserted. Needs root (device nodes, the munge user) and slurm-wlm.
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
from bench.stats import summary_ms
from bench.testbeds.slurm import SlurmCluster, missing_programs
from tests.conftest import LAB_INVENTORY, Broker

STAMPS = 'echo $EPOCHREALTIME; sleep {hold}; echo $EPOCHREALTIME'


def _pair(first: list[str], second: list[str], env: dict[str, str]) -> float:
    """Start two commands 0.3 s apart; the second's start minus the first's end."""
    a = subprocess.Popen(first, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    time.sleep(0.3)
    b = subprocess.Popen(second, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out_a, _ = a.communicate(timeout=120)
    out_b, _ = b.communicate(timeout=120)
    if a.returncode or b.returncode or len(out_a.split()) != 2 or len(out_b.split()) != 2:
        raise RuntimeError(f"a job failed: {a.returncode} {out_a!r}, {b.returncode} {out_b!r}")
    return float(out_b.split()[0]) - float(out_a.split()[1])


def run(samples: int, hold_s: float) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="vaccel-bench-slurm-"))
    cluster = SlurmCluster(root / "cluster")
    broker: Broker | None = None
    try:
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)  # the broker runs Slurm's programs
        workdir = root / "broker"
        workdir.mkdir()
        broker = Broker(workdir, LAB_INVENTORY,
                        f'[slurm]\nmode = "delegate"\nnode = "{cluster.node}"\n').start()
        env = {**cluster.env(), "VACCEL_SOCKET": str(broker.socket)}
        stamps = STAMPS.format(hold=hold_s)
        vaccel = [sys.executable, "-m", "vaccel.cli", "run", "--quiet", "--gpus", "4", "--", "bash", "-c", stamps]
        srun = ["srun", "--quiet", "--gres=gpu:4", "bash", "-c", stamps]
        figures: dict[str, list[float]] = {"vaccel run (delegate)": [], "srun": []}
        for _ in range(samples):
            figures["vaccel run (delegate)"].append(_pair(vaccel, vaccel, env))
            figures["srun"].append(_pair(srun, srun, env))
        return {"samples": samples, "hold_s": hold_s, "rows": {k: summary_ms(v) for k, v in figures.items()}}
    finally:
        if broker is not None:
            broker.stop()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def render(result: dict[str, Any]) -> str:
    rows = result["rows"]
    base = rows["srun"]["p50_ms"] or 1.0
    lines = [f"hand-over, holder's command ends -> waiter's command starts ({result['samples']} pairs, "
             f"hold {result['hold_s']} s, one node, 4 fake GPUs)",
             f"{'':24} {'p50 ms':>9} {'p90 ms':>9} {'max ms':>9} {'p50 / srun':>11}"]
    for name, row in rows.items():
        lines.append(f"{name:24} {row['p50_ms']:9.1f} {row['p90_ms']:9.1f} {row['max_ms']:9.1f} "
                     f"{row['p50_ms'] / base:10.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--hold", type=float, default=1.0, help="seconds each command holds the GPUs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if os.getuid() != 0 or missing_programs():
        print("needs root and slurm-wlm (scripts/setup.sh installs it)", file=sys.stderr)
        return 2
    result = run(args.samples, args.hold)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
