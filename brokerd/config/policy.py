"""The `[policy]` section of the daemon's config: per-user limits with per-group
overrides, the lease time limits, and the fair queue's settings (docs/policy.md).

    [policy]                 fair_half_life, aging, idle_reclaim, idle_warning, lend_idle, lend_notice
    [policy.default]         every user: max_devices, max_waiting, time_default, time_max,
                             max_device_hours, window, max_leases, min_share
    [policy.group.NAME]      members of Unix group NAME: any key of [policy.default]

A user in several configured groups gets the first of them in the file's order. The
groups are the user's (their primary group and every group that lists them, looked up by
user: brokerd/base/groups.py), never the asking process's gid, which the process picks
(`sg`). Every value is checked when the file is read: a bad one is refused with the file,
its line and the key, and a reload keeps the running policy.
"""

from __future__ import annotations

import grp
import re
from dataclasses import dataclass, fields, replace
from typing import Any

from brokerd.base.groups import BOOK
from brokerd.leasing.model import UserLimits
from vaccel_common.units import format_duration, parse_duration, parse_size_mib

_DAY = 86400.0
# Beyond these a value is a typo, not a policy.
_MAX_DEVICES = 4096
_MAX_WAITING = 10_000
_MAX_LEASES = 100_000
_LONGEST = 366 * _DAY


class PolicyError(ValueError):
    """A policy value cannot be used; the message names the key and its line."""


@dataclass(frozen=True)
class Limits:
    """One [policy.default] or [policy.group.NAME] table; None = not set there."""

    max_devices: int | None = None
    max_waiting: int | None = None
    time_default_s: float | None = None
    time_max_s: float | None = None
    max_device_hours: float | None = None
    window_s: float | None = None
    max_leases: int | None = None
    min_share_mib: int | None = None


# max_leases and min_share bound what one user's shares cost everyone (issue 43): each
# lease is a line of everyone's `vaccel status` and a series of the metrics, and a 1 MiB
# share weighs 1/81,920 of a device, so max_devices alone let one user hold thousands.
DEFAULT_LIMITS = Limits(max_devices=0, max_waiting=64, time_default_s=_DAY, time_max_s=7 * _DAY,
                        max_device_hours=0.0, window_s=7 * _DAY, max_leases=64, min_share_mib=1024)


@dataclass(frozen=True)
class EffectiveLimits:
    """What applies to one user: the default table with their group's values on top."""

    name: str  # "default" or "group students"
    max_devices: int
    max_waiting: int
    time_default_s: float
    time_max_s: float
    max_device_hours: float
    window_s: float
    max_leases: int
    min_share_mib: int
    group: str = ""  # the group whose table applies ("students"), "" for the default

    def user_limits(self) -> UserLimits:
        return UserLimits(self.name, self.max_devices, self.max_waiting, self.max_device_hours, self.window_s,
                          self.max_leases, self.min_share_mib)


@dataclass(frozen=True)
class PolicyConfig:
    default: Limits = DEFAULT_LIMITS
    groups: tuple[tuple[str, Limits], ...] = ()  # in the file's order
    fair_half_life_s: float = _DAY
    aging_s: float = _DAY  # the wait bound; the fair order weighs shorter waits (leasing/queue_rules.py)
    idle_reclaim_s: float = 0.0  # 0 = off
    idle_warning_s: float = 300.0  # notice given before an idle lease is reclaimed
    lend_idle: bool = False  # a request over its limits may borrow devices no request within them can use
    lend_notice_s: float = 300.0  # notice a borrowed lease gets when a request within limits needs its device

    def for_user(self, user: str) -> EffectiveLimits:
        """The limits of the user named `user`: [policy.default] under the first group table,
        in the file's order, of a group the user belongs to (never the process's own gid: the
        process picks that)."""
        base, name, chosen = self.default, "default", ""
        if self.groups:
            mine = BOOK.of(user).names
            for group, limits in self.groups:
                if group in mine:
                    base = replace(base, **{f.name: getattr(limits, f.name) for f in fields(Limits)
                                            if getattr(limits, f.name) is not None})
                    name, chosen = f"group {group}", group
                    break
        values = {f.name: getattr(base, f.name) for f in fields(Limits)}
        return EffectiveLimits(name=name, group=chosen, **values)


def counted_gid(policy: PolicyConfig, user: str, process_gid: int) -> int:
    """The group a user's lease counts under (`vaccel report --by group`): the group whose
    table the policy applies to them, else their primary group; the process's own gid
    (its to pick) only for a user this host does not know."""
    chosen = policy.for_user(user).group
    if chosen:
        try:
            return grp.getgrnam(chosen).gr_gid
        except KeyError:
            pass  # removed since the policy was read: as if no table applied
    primary = BOOK.of(user).primary_gid
    return primary if primary is not None else process_gid


_LIMIT_KEYS = {
    "max_devices": ("max_devices", int),
    "max_waiting": ("max_waiting", int),
    "time_default": ("time_default_s", parse_duration),
    "time_max": ("time_max_s", parse_duration),
    "max_device_hours": ("max_device_hours", float),
    "window": ("window_s", parse_duration),
    "max_leases": ("max_leases", int),
    "min_share": ("min_share_mib", parse_size_mib),
}
_TOP_KEYS = {
    "fair_half_life": "fair_half_life_s",
    "aging": "aging_s",
    "idle_reclaim": "idle_reclaim_s",
    "idle_warning": "idle_warning_s",
    "lend_notice": "lend_notice_s",
}


def line_of(text: str, table: str, key: str) -> int:
    """The line `key` is written on inside `[table]` (0 when it cannot be found): tomllib
    gives values, not positions, and a refusal should point at the line to fix."""
    current = ""
    header = re.compile(r"^\s*\[\s*([^\]]+?)\s*\]")
    for number, line in enumerate(text.splitlines(), start=1):
        found = header.match(line)
        if found:
            current = found.group(1).replace(" ", "").replace('"', "")
            if not key and current == table:
                return number
            continue
        if key and current == table and re.match(rf"^\s*\"?{re.escape(key)}\"?\s*=", line):
            return number
    return 0


def _checked(key: str, raw: Any, parse: Any) -> Any:
    if isinstance(raw, bool) or (parse in (int, float) and not isinstance(raw, (int, float))):
        raise ValueError(f"must be a number, got {raw!r}")
    value = parse(raw)
    if parse is int and value != raw:
        raise ValueError(f"must be a whole number, got {raw!r}")
    if value < 0:
        raise ValueError(f"must not be negative, got {raw!r}")
    ceilings = {"max_devices": _MAX_DEVICES, "max_waiting": _MAX_WAITING, "max_device_hours": _MAX_DEVICES * 24 * 366,
                "max_leases": _MAX_LEASES, "min_share": 1 << 30}
    if key in ceilings and value > ceilings[key]:
        raise ValueError(f"{raw!r} is absurd (at most {ceilings[key]})")
    if parse is parse_duration and value > _LONGEST:
        raise ValueError(f"{raw!r} is absurd (at most {format_duration(_LONGEST)})")
    return value


def _limits(table: dict[str, Any], name: str, where: Any) -> Limits:
    values = {}
    for key, raw in table.items():
        if key not in _LIMIT_KEYS:
            raise where(name, key, f"unknown key {key!r}; known keys: {', '.join(_LIMIT_KEYS)}")
        attr, parse = _LIMIT_KEYS[key]
        try:
            values[attr] = _checked(key, raw, parse)
        except (TypeError, ValueError) as exc:
            raise where(name, key, str(exc)) from None
    limits = Limits(**values)
    if limits.window_s is not None and limits.window_s < 3600:
        raise where(name, "window", "must be at least 1h")
    return limits


def parse_policy(doc: dict[str, Any], source: str, text: str = "") -> PolicyConfig:
    """The [policy] table of a config file (`doc`), checked; `text` finds line numbers."""
    def where(table: str, key: str, why: str) -> PolicyError:
        line = line_of(text, table, key) if text else 0
        return PolicyError(f"{source}{f':{line}' if line else ''}: {table}.{key}: {why}")

    if not isinstance(doc, dict):
        raise PolicyError(f"{source}: policy must be a table")
    top: dict[str, Any] = {}
    default = DEFAULT_LIMITS
    groups: list[tuple[str, Limits]] = []
    for key, value in doc.items():
        if key == "default":
            if not isinstance(value, dict):
                raise where("policy", key, "must be a table ([policy.default])")
            given = _limits(value, "policy.default", where)
            default = replace(DEFAULT_LIMITS, **{f.name: getattr(given, f.name) for f in fields(Limits)
                                                 if getattr(given, f.name) is not None})
        elif key == "group":
            if not isinstance(value, dict):
                raise where("policy", key, "must be tables ([policy.group.NAME])")
            for group, table in value.items():
                name = f"policy.group.{group}"
                if not isinstance(table, dict):
                    raise where("policy.group", group, "must be a table ([policy.group.NAME])")
                try:
                    grp.getgrnam(group)
                except KeyError:
                    line = line_of(text, name, "") if text else 0
                    raise PolicyError(f"{source}{f':{line}' if line else ''}: [{name}]: there is no Unix group "
                                      f"{group!r} on this host (getent group {group})") from None
                groups.append((group, _limits(table, name, where)))
        elif key == "lend_idle":
            if not isinstance(value, bool):
                raise where("policy", key, f"must be true or false, got {value!r}")
            top["lend_idle"] = value
        elif key in _TOP_KEYS:
            try:
                top[_TOP_KEYS[key]] = _checked(key, value, parse_duration)
            except (TypeError, ValueError) as exc:
                raise where("policy", key, str(exc)) from None
        else:
            known = ", ".join([*_TOP_KEYS, "lend_idle", "default", "group"])
            raise where("policy", key, f"unknown key {key!r}; known keys: {known}")
    policy = PolicyConfig(default=default, groups=tuple(groups), **top)
    for name, limits in [("policy.default", policy.default), *((f"policy.group.{g}", lim) for g, lim in groups)]:
        effective = replace(policy.default, **{f.name: getattr(limits, f.name) for f in fields(Limits)
                                               if getattr(limits, f.name) is not None})
        if effective.time_default_s and effective.time_max_s and effective.time_default_s > effective.time_max_s:
            key = "time_default" if limits.time_default_s is not None else "time_max"
            raise where(name, key, f"time_default ({format_duration(effective.time_default_s)}) is longer than "
                                   f"time_max ({format_duration(effective.time_max_s)})")
        if effective.time_max_s is not None and effective.time_max_s < 60:
            raise where(name, "time_max", "must be at least 1m")
    return policy
