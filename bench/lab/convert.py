"""Turn a lab's own accounting into a trace for `python -m bench.lab --trace FILE`.

    sacct -a -X -P -S 2025-03-03 -E 2025-03-10 \\
          -o JobID,User,JobName,Submit,Start,End,Timelimit,AllocTRES > week.sacct
    python -m bench.lab.convert sacct week.sacct --default-time 1-00:00:00 > week.jsonl

    vaccel report --from 2025-03-03 --to 2025-03-09 --by lease --csv > week.csv
    python -m bench.lab.convert vaccel week.csv --default-time 24h > week.jsonl

A job's duration is how long it held its GPUs; its submission time counts from the
earliest one. Jobs that never started, or held no GPU, are left out (counted on stderr).
Neither system records whether a user typed `--time`: a limit equal to `--default-time`
(the partition's DefaultTime, the broker's time_default) is taken as "none given".
Interactive: a Slurm job named "interactive" (salloc's name) or after a shell; a vaccel
reservation (`vaccel reserve`).
"""

from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from bench.lab.trace import BATCH, INTERACTIVE, Job, TraceError, to_jsonl
from vaccel_common.units import parse_duration

SACCT_COLUMNS = ("User", "JobName", "Submit", "Start", "End", "Timelimit", "AllocTRES")
VACCEL_COLUMNS = ("user", "requested_at", "granted_at", "ended_at", "devices", "time_limit_s", "reservation")
SHELLS = {"interactive", "bash", "sh", "zsh", "fish", "tcsh", "csh"}
_GPUS = re.compile(r"gres/gpu(?::[^=,]+)?=(\d+)")


def slurm_duration(text: str) -> float:
    """Seconds of a Slurm time: "1-02:00:00", "02:00:00", "30:00" (m:s), "45" (minutes),
    "2-12" (d-h); 0 for UNLIMITED, Partition_Limit and anything else."""
    days, _, rest = text.strip().rpartition("-")
    parts = rest.split(":")
    if len(parts) > 3 or not all(p.isdigit() for p in parts) or (days and not days.isdigit()):
        return 0.0
    numbers = [int(p) for p in parts]
    if days:  # d-h, d-h:m, d-h:m:s
        hours, minutes, seconds = numbers + [0] * (3 - len(numbers))
    else:  # h:m:s, m:s, m
        hours, minutes, seconds = [0] * (3 - len(numbers)) + numbers if len(numbers) > 1 else (0, numbers[0], 0)
    return int(days or 0) * 86400.0 + hours * 3600.0 + minutes * 60.0 + seconds


def _moment(text: str, where: str) -> float | None:
    if text.strip() in ("", "Unknown", "None"):
        return None
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise TraceError(f"{where}: not a time: {text!r}") from None


def _rows(text: str, delimiter: str, needed: Iterable[str], name: str) -> list[dict[str, str]]:
    reader = csv.DictReader(io.StringIO(text), delimiter=delimiter)
    missing = [c for c in needed if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(f"{name}: the header lacks {', '.join(missing)}")
    return list(reader)


def _jobs(entries: list[tuple[str, float, float, float, int, float, str]]) -> list[Job]:
    """(user, submitted, started, ended, gpus, limit, kind) -> jobs from the first submission."""
    first = min((e[1] for e in entries), default=0.0)
    jobs = [Job(0, user, round(submitted - first), gpus, round(ended - started), limit, kind)
            for user, submitted, started, ended, gpus, limit, kind in sorted(entries, key=lambda e: e[1])]
    return [Job(i, j.user, j.submit_s, j.gpus, j.duration_s, j.time_limit_s, j.kind) for i, j in enumerate(jobs, 1)]


def from_sacct(text: str, default_time_s: float, name: str = "<sacct>") -> tuple[list[Job], int]:
    """Jobs from `sacct -P` output, and how many rows were left out."""
    entries, skipped = [], 0
    for number, row in enumerate(_rows(text, "|", SACCT_COLUMNS, name), start=2):
        where = f"{name}: line {number}"
        submitted, started, ended = (_moment(row[c], where) for c in ("Submit", "Start", "End"))
        found = _GPUS.search(row["AllocTRES"])
        gpus = int(found.group(1)) if found else 0
        if submitted is None or started is None or ended is None or ended <= started or not gpus:
            skipped += 1
            continue
        limit = slurm_duration(row["Timelimit"])
        kind = INTERACTIVE if row["JobName"].strip() in SHELLS else BATCH
        entries.append((row["User"], submitted, started, ended, gpus, 0.0 if limit == default_time_s else limit, kind))
    return _jobs(entries), skipped


def from_vaccel(text: str, default_time_s: float, name: str = "<report>") -> tuple[list[Job], int]:
    """Jobs from `vaccel report --by lease --csv`, and how many rows were left out."""
    entries, skipped = [], 0
    for number, row in enumerate(_rows(text, ",", VACCEL_COLUMNS, name), start=2):
        try:
            submitted, started, ended = (float(row[c]) for c in ("requested_at", "granted_at", "ended_at"))
            gpus, limit = int(row["devices"]), float(row["time_limit_s"])
        except ValueError as exc:
            raise TraceError(f"{name}: line {number}: {exc}") from None
        if ended <= started or not gpus:
            skipped += 1
            continue
        kind = INTERACTIVE if row["reservation"].strip().lower() in ("1", "true", "yes") else BATCH
        entries.append((row["user"], submitted or started, started, ended, gpus,
                        0.0 if limit == default_time_s else limit, kind))
    return _jobs(entries), skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", choices=("sacct", "vaccel"), help="what the file is")
    parser.add_argument("file", help="the accounting export ('-' for stdin)")
    parser.add_argument("--default-time", default="", help="the limit jobs got without --time (taken as none)")
    args = parser.parse_args(argv)
    try:
        default_s = -1.0  # no limit is taken as the default
        if args.default_time:
            read_time = slurm_duration if args.source == "sacct" else parse_duration
            default_s = read_time(args.default_time)
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        convert = from_sacct if args.source == "sacct" else from_vaccel
        jobs, skipped = convert(text, default_s, args.file)
    except (OSError, ValueError) as exc:
        print(f"bench.lab.convert: {exc}", file=sys.stderr)
        return 2
    if not jobs:
        print(f"bench.lab.convert: {args.file}: no job that held a GPU", file=sys.stderr)
        return 2
    print(to_jsonl(jobs), end="")
    if skipped:
        print(f"bench.lab.convert: left out {skipped} job(s) that never started or held no GPU", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
