"""The holders line: who holds what, at the end of every queue update and Busy refusal.

On a workstation it names each device's holder ("gpu0 alice since 10:02, gpu1 bob since
09:41"). On a large host that line had 64 entries, ~1.6 KB, and it reached every waiter
at every change of the queue: 500 copies a change, which nobody reads. Past
HOLDERS_LISTED entries it counts the devices per user instead ("62 of 64 devices leased:
alice 40, bob 20, carol 2; 1 drained, 1 unhealthy"), which is what a person asks of a
big host: who has most of it.
"""

from __future__ import annotations

import time
from collections import Counter

from brokerd.leasing.holdings import Holdings
from vaccel_common.units import format_mib

HOLDERS_LISTED = 8  # entries named one by one; past that, devices are counted per user
USERS_NAMED = 5  # in the counted form, the users with most devices; the rest are counted
SHARES_NAMED = 4  # a shared device's shares named one by one; past that, memory per user


def holders_line(holdings: Holdings) -> str:
    entries: list[str] = []
    per_user: Counter[str] = Counter()
    others: Counter[str] = Counter()
    for device in sorted(holdings.devices.values(), key=lambda d: (d.index, d.mig_index)):
        lease_id = holdings.owner.get(device.uuid)
        name = device.label
        if lease_id is not None:
            lease = holdings.leases[lease_id]
            user = str(lease.holder.user or lease.holder.uid)
            per_user[user] += 1
            since = time.strftime("%H:%M", time.localtime(lease.granted_at))
            entries.append(f"{name} {user} since {since}")
        elif device.uuid in holdings.shares:
            shares = [holdings.leases[i] for i in holdings.shares[device.uuid]]
            for lease in shares:
                per_user[str(lease.holder.user or lease.holder.uid)] += lease.weight
            entries.append(f"{name} shared: {_shares(shares)}, {format_mib(max(0, holdings.room(device.uuid)))} free")
        elif device.uuid in holdings.drained:
            others["drained"] += 1
            entries.append(f"{name} drained: {holdings.drained[device.uuid]}")
        elif device.uuid in holdings.unavailable:
            others["busy"] += 1
            entries.append(f"{name} busy: {holdings.unavailable[device.uuid]}")
        elif not device.healthy:
            others["unhealthy"] += 1
            entries.append(f"{name} unhealthy")
    if len(entries) <= HOLDERS_LISTED:
        return ", ".join(entries) if entries else "no device is leased"
    return _counted(per_user, others, len(holdings.devices))


def _shares(shares: list) -> str:
    """A shared device's shares: each named, or past SHARES_NAMED the memory per user (one
    user's thousands of shares made a refusal 128 KB, issue 43)."""
    if len(shares) <= SHARES_NAMED:
        return ", ".join(f"{lease.holder.user or lease.holder.uid} {format_mib(lease.share_mib)}" for lease in shares)
    mib: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for lease in shares:
        user = str(lease.holder.user or lease.holder.uid)
        mib[user] += lease.share_mib
        count[user] += 1
    users = sorted(mib, key=lambda u: (-mib[u], u))
    line = ", ".join(f"{u} {format_mib(mib[u])} in {count[u]}" for u in users[:USERS_NAMED])
    return line + (f" and {len(users) - USERS_NAMED} more users" if len(users) > USERS_NAMED else "")


def _counted(per_user: Counter[str], others: Counter[str], devices: int) -> str:
    users = sorted(per_user.items(), key=lambda item: (-item[1], item[0]))
    if users:  # a share counts as its part of its device: "alice 2.25"
        line = f"{sum(per_user.values()):.3g} of {devices} devices leased: " + ", ".join(
            f"{user} {count:.3g}" for user, count in users[:USERS_NAMED])
        if len(users) > USERS_NAMED:
            line += f" and {len(users) - USERS_NAMED} more users"
    else:
        line = "no device is leased"
    rest = [f"{others[kind]} {kind}" for kind in ("drained", "busy", "unhealthy") if others[kind]]
    return f"{line}; {', '.join(rest)}" if rest else line
