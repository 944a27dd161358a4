"""`%vaccel` in a notebook: which lease this kernel holds, on which devices, for how long.

The vaccel kernel loads it itself; in another IPython, `%load_ext vaccel.kernel.magic`.
The same facts come from Python as `vaccel.current_lease()` (the Lease object); the time
left is asked from the broker, which alone knows it (a time limit, an admin's notice).
"""

from __future__ import annotations

import os
import time
from typing import Any

from vaccel_common.units import format_duration


def describe(held: Any, record: Any | None) -> str:
    """Lines for a lease (vaccel.Lease) and its record from the broker (None: unreachable)."""
    devices = ", ".join(f"{d.label} {d.name}" for d in held.devices) or "no device"
    lines = [f"lease {held.id}: {devices}", f"backend {held.backend}" + (" (simulated)" if held.simulated else "")]
    if record is None:
        lines.append("time left: unknown (the broker did not answer)")
    elif record.state != "active":
        lines.append(f"ended: {record.state}" + (f" ({record.end_reason})" if record.end_reason else ""))
    elif record.expires_at:
        lines.append(f"time left: {format_duration(max(0.0, record.expires_at - time.time()))}")
    else:
        lines.append("time left: no time limit")
    if record is not None and record.notice:
        lines.append(f"notice: {record.notice}")
    return "\n".join(lines)


def lease_record(lease_id: str) -> Any | None:
    """The broker's view of the lease (a vaccel.v1 Lease message), None when it cannot say."""
    import grpc

    from vaccel.session.connection import BrokerConnection, BrokerUnavailable
    from vaccel_common.v1 import broker_pb2 as pb

    connection = BrokerConnection()
    try:
        return connection.call("GetLease", pb.LeaseRef(lease_id=lease_id), timeout=5)
    except (BrokerUnavailable, grpc.RpcError):
        return None
    finally:
        connection.close()


def vaccel_magic(line: str = "") -> None:
    """%vaccel: this kernel's lease (id, devices, backend, time left)."""
    from vaccel.current import current_lease

    held = current_lease()
    if held is None:
        inherited = os.environ.get("VACCEL_LEASE_ID")
        print(f"inside lease {inherited} (from the environment)" if inherited else
              "no lease: this kernel runs without devices; pick a \"vaccel\" kernel to get one")
        return
    print(describe(held, lease_record(held.id)))


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magic_function(vaccel_magic, "line", "vaccel")
