"""`vaccel status` stays small whatever others queue (issue 46): the text lists the first
QUEUE_SHOWN waiting requests and counts the rest; `--all` (and `--json`) list every one."""

from __future__ import annotations

import json

from vaccel_common.status_json import status_json
from vaccel_common.status_text import QUEUE_SHOWN, render_status
from vaccel_common.v1 import broker_pb2 as pb


def waiting(n: int) -> pb.StatusReply:
    reply = pb.StatusReply(hostname="lab")
    for i in range(1, n + 1):
        entry = reply.queue.add(request_id=f"r-{i}", gpus=1, position=i, reason="all devices are leased")
        entry.requester.user, entry.requester.pid, entry.requester.command = f"user{i}", 1000 + i, "train.py"
    return reply


def test_the_queue_beyond_the_first_lines_is_counted_and_all_lists_every_one():
    reply = waiting(QUEUE_SHOWN + 990)
    text = render_status(reply)
    assert f"queue ({QUEUE_SHOWN + 990} waiting):" in text
    assert f"  {QUEUE_SHOWN}. user{QUEUE_SHOWN} " in text and f"user{QUEUE_SHOWN + 1} " not in text
    assert text.splitlines()[-1] == "  ... and 990 more waiting (vaccel status --all)"
    assert len(text) < 3000  # ten requests' lines, not a thousand's
    every = render_status(reply, every=True)
    assert f"  {QUEUE_SHOWN + 990}. user{QUEUE_SHOWN + 990} " in every and "more waiting" not in every
    assert len(json.loads(json.dumps(status_json(reply)))["queue"]) == QUEUE_SHOWN + 990


def test_a_short_queue_is_listed_whole():
    text = render_status(waiting(QUEUE_SHOWN))
    assert f"  {QUEUE_SHOWN}. user{QUEUE_SHOWN} " in text and "more waiting" not in text
