"""Lab-trace benchmark: one lab's GPU use replayed, time-compressed, against vaccel with its
defaults, vaccel with a lab's policy, and a real single-node Slurm with backfill, on the
same number of simulated GPUs; per system the figures a lab head reads (bench/lab/metrics.py)
and vaccel's ratios against Slurm.

    sudo python -m bench.lab                      # seed 1, a lab day at 180x: ~10 min per system
    sudo python -m bench.lab --hours 168 --speed 1200 --systems vaccel,slurm-fs
    python -m bench.lab --trace mylab.jsonl --systems vaccel --json
    python -m bench.lab --seed 3 --write-trace trace.jsonl   # the trace only, no replay

Slurm needs root and slurm-wlm (scripts/setup.sh installs it), slurm-fs also slurmdbd and
mariadb-server, and makes a Unix account per lab user (vlab-NAME); vaccel's users get uids of
their own only as root (else they share ours, and the fair queue sees one user). The trace
format and the converters from `sacct` and `vaccel report --by lease`: docs/performance.md.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from bench.lab import faults, plan, replay_slurm, replay_vaccel
from bench.lab.metrics import figures, ratios
from bench.lab.trace import HOUR, TraceError, generate, read, summary, to_jsonl
from vaccel_common.units import format_duration


def _systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in plan.SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown system {', '.join(unknown) or '(none)'}; "
                                         f"choose from {', '.join(plan.SYSTEMS)}")
    return list(dict.fromkeys(names))


def _faults(text: str) -> list[faults.Fault]:
    try:
        return faults.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", metavar="FILE", help="replay this trace (JSON lines or CSV)")
    source.add_argument("--seed", type=int, default=1, help="generate the trace from this seed (default 1)")
    parser.add_argument("--hours", type=float, default=24.0, help="generated trace's length in lab hours (24)")
    parser.add_argument("--users", type=int, default=20, help="people in the generated trace (20)")
    parser.add_argument("--speed", type=float, default=180.0, help="lab seconds per real second (180: 1 h in 20 s)")
    parser.add_argument("--devices", type=int, default=8, help="simulated GPUs on each system (8)")
    parser.add_argument("--systems", type=_systems, default=list(plan.DEFAULT_SYSTEMS),
                        help=f"comma-separated, from {','.join(plan.SYSTEMS)} "
                             f"(default: {','.join(plan.DEFAULT_SYSTEMS)})")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="real seconds one system's replay may take before it is called failed (3600)")
    parser.add_argument("--write-trace", metavar="FILE", help="write the trace (JSON lines) and exit")
    parser.add_argument("--faults", metavar="SPEC", type=_faults, default=None,
                        help="inject faults into the vaccel systems' replays, e.g. "
                             "kill9=45m,restart=6h,enospc=3h,clock=+10m@5h (bench/lab/faults.py)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def _problem(args: argparse.Namespace) -> str:
    if args.faults and faults.enospc_needs_root(args.faults):
        return faults.enospc_needs_root(args.faults)
    if args.speed <= 0 or args.hours <= 0 or args.users < 1 or args.devices < 1 or args.timeout <= 0:
        return "--speed, --hours, --timeout must be positive; --users and --devices at least 1"
    if any(name.startswith("slurm") for name in args.systems):
        from bench.testbeds.slurm import missing_programs

        if os.geteuid() != 0 or missing_programs():
            return "the slurm system needs root and slurm-wlm (scripts/setup.sh installs it); or --systems vaccel"
    if any(name.startswith("slurm-fs") for name in args.systems):
        from bench.testbeds.slurm_accounting import missing_programs as accounting_missing

        if accounting_missing():
            return (f"slurm-fs needs {', '.join(accounting_missing())} (Debian's slurmdbd and mariadb-server: "
                    "scripts/setup.sh installs them)")
    return ""


def run(args: argparse.Namespace, jobs: list[Any]) -> dict[str, Any]:
    compression = plan.Compression(args.speed)
    too_big = [j.id for j in jobs if j.gpus > args.devices]
    if too_big:
        raise TraceError(f"job(s) {too_big[:5]} ask for more than the {args.devices} devices")
    systems: dict[str, dict[str, Any]] = {}
    setup: dict[str, Any] = {}
    failed: dict[str, str] = {}
    # The ratios are taken against Slurm as a lab runs it (fair share) when it ran, else FIFO Slurm.
    reference = "slurm-fs" if "slurm-fs" in args.systems else "slurm"
    for name in args.systems:
        began = time.monotonic()
        steps = plan.steps(jobs, name, compression)
        try:
            if name.startswith("slurm"):
                outcomes, setup[name] = replay_slurm.replay(steps, compression, args.devices, args.timeout, name)
                injected: dict[str, Any] | str = "not applicable (faults are injected into vaccel's daemon)"
            else:
                outcomes, setup[name] = replay_vaccel.replay(steps, name, compression, args.devices, args.timeout,
                                                             args.faults)
                injected = setup[name].pop("faults", {})
        except Exception as exc:  # the other systems' figures are kept: a run is long
            failed[name] = str(exc) if isinstance(exc, replay_vaccel.ReplayError) else f"{type(exc).__name__}: {exc}"
            print(f"bench.lab: {exc}", file=sys.stderr, flush=True)
            continue
        systems[name] = {**figures(outcomes, args.devices), "replay_s": time.monotonic() - began,
                         "outcomes": [asdict(o) for o in outcomes]}
        if args.faults:
            systems[name]["faults"] = injected
        done = systems[name]
        print(f"bench.lab: {name} done in {done['replay_s']:.0f} s: utilization {done['utilization']:.3f}, "
              f"wait p50 {format_duration(done['wait_p50_s'])}, makespan {format_duration(done['makespan_s'])}",
              file=sys.stderr, flush=True)
    return {"trace": {**summary(jobs, args.devices), "source": args.trace or f"seed {args.seed}"},
            "devices": args.devices, "speed": args.speed, "limit_step_s": compression.limit_step_s,
            "distinct_uids": os.geteuid() == 0, "systems": systems, "reference": reference,
            "ratios": ratios(systems, reference), "like": _like_ratios(systems), "setup": setup, "failed": failed}


# Like against like (issue 45): the lab's policy on both sides (the same --time rule, a
# per-user cap), beside the ratios against the reference.
LIKE = (("vaccel-policy", "slurm-fs-policy"),)


def _like_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    return {f"{ours} / {theirs}": ratios({ours: systems[ours], theirs: systems[theirs]}, theirs)[ours]
            for ours, theirs in LIKE if ours in systems and theirs in systems}


def _ratio(ratios: dict[str, float | None], key: str, width: int) -> str:
    value = ratios[key]
    return f"{value:>{width - 1}.2f}x" if value is not None else f"{'-':>{width}}"


def render(result: dict[str, Any]) -> str:
    t = result["trace"]
    lines = [f"lab trace ({t['source']}): {t['jobs']} jobs of {t['users']} users, {t['with_time']} with --time, "
             f"{t['interactive']} interactive; {t['gpu_hours']:.0f} GPU-hours offered "
             f"(load {t['offered_load']:.2f} on {result['devices']} GPUs)",
             f"replayed at {result['speed']:g}x (1 lab hour = {HOUR / result['speed']:.1f} s); time limits in steps "
             f"of {format_duration(result['limit_step_s'])} (one real minute, Slurm's unit) on every system; "
             "lab time below",
             "",
             f"{'':32}{'util':>7}{'idle-wait':>11}{'wait p50':>10}{'wait p90':>10}{'wait max':>10}{'Jain':>7}"
             f"{'slowdown':>14}{'makespan':>10}",
             f"{'':32}{'':>7}{'dev-hours':>11}{'':>30}{'':>7}{'med / max':>14}"]
    for name, s in result["systems"].items():
        lines.append(f"{name:<32}{s['utilization']:>7.3f}{s['idle_while_waiting_s'] / HOUR:>11.1f}"
                     f"{format_duration(s['wait_p50_s']):>10}{format_duration(s['wait_p90_s']):>10}{format_duration(s['wait_max_s']):>10}"
                     f"{s['jain']:>7.3f}{s['slowdown_user_median']:>7.2f} /{s['slowdown_user_max']:>5.1f}"
                     f"{format_duration(s['makespan_s']):>10}")
    pairs = [(f"{name} / {result['reference']}", r) for name, r in result["ratios"].items()]
    for label, r in [*pairs, *result.get("like", {}).items()]:
        lines.append(f"{label:<32}{_ratio(r, 'utilization', 7)}{_ratio(r, 'idle_while_waiting_s', 11)}"
                     f"{_ratio(r, 'wait_p50_s', 10)}{_ratio(r, 'wait_p90_s', 10)}{_ratio(r, 'wait_max_s', 10)}"
                     f"{_ratio(r, 'jain', 7)}{_ratio(r, 'slowdown_user_median', 8)}{'':6}{_ratio(r, 'makespan_s', 10)}")
    for name, s in result["systems"].items():
        f = s.get("faults")
        if isinstance(f, dict) and f:
            lines.append(f"{name} faults {f['injected']}: {f['jobs_completed']}/{f['jobs_expected']} jobs completed, "
                         f"{f['jobs_lost']} lost, {f['double_grants']} double grants, "
                         f"{f['accounting_rows_missing']} accounting rows missing")
    for name, why in result.get("failed", {}).items():
        lines.append(f"{name}: FAILED: {why.splitlines()[0]}")
    if not result["distinct_uids"]:
        lines.append("(not root: every vaccel user ran under one uid, so the fair queue saw one user)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        jobs = read(args.trace) if args.trace else generate(args.seed, args.hours, args.users)
        if args.write_trace:
            with open(args.write_trace, "w") as out:
                out.write(to_jsonl(jobs))
            return 0
        problem = _problem(args)
        if problem:
            print(f"bench.lab: {problem}", file=sys.stderr)
            return 2
        result = run(args, jobs)
    except TraceError as exc:
        print(f"bench.lab: {exc}", file=sys.stderr)
        return 2
    except replay_vaccel.ReplayError as exc:
        print(f"bench.lab: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.lab: interrupted; daemons and temp files cleaned up", file=sys.stderr)
        return 130
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
