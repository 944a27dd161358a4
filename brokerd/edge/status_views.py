"""The views a short-lived `vaccel status` asks for on the identity socket
(vaccel_common/side_call.py VIEWS): the Status reply the caller may see, rendered as the
full CLI would print it, so that the client needs neither protobuf nor the renderer.

The text and the JSON are the CLI's own code (vaccel_common/status_text.py,
status_json.py), run here on the reply the servicer's Status method gave this caller;
only the clock of each lease's start is left for the client to write in its time zone.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from vaccel_common.side_call import marked_text
from vaccel_common.status_json import status_json
from vaccel_common.status_text import clock_marks
from vaccel_common.v1 import broker_pb2 as pb


def status_text(reply: pb.StatusReply) -> bytes:
    return marked_text(*clock_marks(reply))


def status_json_text(reply: pb.StatusReply) -> bytes:
    return marked_text(json.dumps(status_json(reply), indent=2), [])


RENDERERS: dict[str, Callable[[pb.StatusReply], bytes]] = {"StatusText": status_text, "StatusJson": status_json_text}
