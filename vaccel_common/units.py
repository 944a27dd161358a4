"""Parsing of the sizes and durations users type: "20GiB", "512M", "90s", "2h", "1d12h",
and a time limit as Slurm writes it ("01:30:00", "1-12:00").

Shared by the CLI, lease() and the daemon's config so one spelling means one thing.
"""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800,
                   "y": 365 * 86400}  # a year of reports (`--since 1y`): 365 days, as DESIGN.md says
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|min|[smhdwy])", re.IGNORECASE)


def parse_size_mib(value: str | int | float) -> int:
    """Return a size in MiB (rounded up). Bare numbers are bytes; "20GiB" and "20G" are
    binary, "20GB" decimal. Raises ValueError with the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    else:
        match = _SIZE_RE.match(value)
        if not match or match.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"not a size: {value!r} (try 512MiB, 20GiB, 80G)")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise ValueError(f"size must not be negative: {value!r}")
    size_bytes = number * _SIZE_UNITS[unit]
    return int(-(-size_bytes // (1024**2)))


def parse_share_mib(value: str | int | float) -> int:
    """A memory share's size in MiB (parse_size_mib), which must be more than nothing: on the
    wire a share of 0 MiB is no share at all, so `--memory 0GiB` was granted whole devices
    (issue 43). The broker refuses what is under its policy's min_share itself."""
    mib = parse_size_mib(value)
    if mib <= 0:
        raise ValueError(f"a memory share of {value!r} is nothing: ask for a size, e.g. 10GiB, "
                         "or for whole devices without it")
    return mib


def parse_duration(value: str | int | float) -> float:
    """Return seconds. Bare numbers are seconds; "90s", "15m", "2h", "1d12h", "2w", "1y" (365 days)
    are accepted."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION_PART_RE.findall(text)
            if not parts or _DURATION_PART_RE.sub("", text).strip():
                raise ValueError(f"not a duration: {value!r} (try 30s, 15m, 2h, 1d, 2w, 1y)") from None
            seconds = sum(float(n) * _DURATION_UNITS[u.lower()] for n, u in parts)
    if seconds < 0:
        raise ValueError(f"duration must not be negative: {value!r}")
    return seconds


# Slurm's --time forms (sbatch(1)): MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS. Its bare
# "MM" is not here: a bare number is seconds to parse_duration and minutes to Slurm, so the
# CLI refuses it with a hint instead of guessing (vaccel/cli/common.py: time_arg).
_SLURM_TIME_RE = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(?:(\d+):)?(\d+):(\d+))$")


def parse_time_limit(value: str | int | float) -> float:
    """Seconds of a time limit: what parse_duration takes ("90m", "2h", 3600), or one of
    Slurm's forms ("30:00", "01:30:00", "1-12", "1-12:30", "1-12:30:00")."""
    text = value.strip() if isinstance(value, str) else ""
    match = _SLURM_TIME_RE.match(text)
    if match is None:
        try:
            return parse_duration(value)
        except ValueError as exc:
            if not str(exc).startswith("not a duration"):
                raise
            raise ValueError(f"not a duration: {value!r} (try 90m, 2h, 1d12h, or as Slurm writes it: "
                             "01:30:00, 1-12:00:00)") from None
    days, day_hours, day_minutes, day_seconds, hours, minutes, seconds = match.groups()
    if days is not None:
        parts = (int(days), int(day_hours), int(day_minutes or 0), int(day_seconds or 0))
    else:
        parts = (0, int(hours or 0), int(minutes), int(seconds))
    d, h, m, s = parts
    return float(((d * 24 + h) * 60 + m) * 60 + s)


def format_mib(mib: int) -> str:
    return f"{mib / 1024:.0f} GiB" if mib >= 1024 and mib % 1024 == 0 else (
        f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib} MiB")


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"
