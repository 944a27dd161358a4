"""The views a short-lived `vaccel` asks for on the identity socket
(vaccel_common/side_call.py VIEWS): the reply the servicer's own method gave this caller,
rendered as the full CLI would use it, so that the client needs neither protobuf nor the
CLI's renderers (vaccel/entry.py, vaccel/run/quick_run.py).

- StatusText, StatusJson: `vaccel status` and `vaccel status --json` with the CLI's own
  code (vaccel_common/status_text.py, status_json.py); only the clock of each lease's start
  is left for the client to write in its time zone.
- RunNow: a TryAcquire's answer for a plain `vaccel run`: "wait", or the grant with the
  lines the runner says (vaccel_common/grant_text.py), the variables it sets for the
  command (vaccel_common/backends.py granted_env, and DEVICE_ENV_VARS to remove), and the
  AcquireUpdate itself for the full runner to take the lease over.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from vaccel_common.backends import DEVICE_ENV_VARS, granted_env
from vaccel_common.grant_text import grant_lines
from vaccel_common.side_call import marked_text, packed
from vaccel_common.status_json import status_json
from vaccel_common.status_text import clock_marks
from vaccel_common.v1 import broker_pb2 as pb


def status_text(reply: pb.StatusReply) -> bytes:
    return marked_text(*clock_marks(reply))


def status_json_text(reply: pb.StatusReply) -> bytes:
    return marked_text(json.dumps(status_json(reply), indent=2), [])


def run_now(update: pb.AcquireUpdate) -> bytes:
    if not update.HasField("granted"):
        return packed([b"wait"])
    lease = update.granted
    lines = grant_lines(lease.id, [(d.label or f"gpu{d.index}", d.name) for d in lease.devices], lease.simulated,
                        [f"{w.name}: {w.message}" for w in lease.warnings], share_mib=lease.share_mib)
    env = granted_env(lease)
    return packed([b"granted", lease.id.encode(), "\0".join(lines).encode(), update.SerializeToString(),
                   "\0".join(f"{k}={v}" for k, v in env.items()).encode(), "\0".join(DEVICE_ENV_VARS).encode(),
                   repr(lease.heartbeat_interval_s or 5.0).encode()])


RENDERERS: dict[str, Callable[[Any], bytes]] = {"StatusText": status_text, "StatusJson": status_json_text,
                                                "RunNow": run_now}
