"""A lease's container (brokerd/leasing/model.py, ContainerHold) as the store keeps it: one
JSON text column of the lease's row, "" for a lease applied to no container."""

from __future__ import annotations

import json
from dataclasses import asdict

from brokerd.base.process import ProcessId
from brokerd.leasing.model import ContainerHold


def container_text(hold: ContainerHold | None) -> str:
    return json.dumps(asdict(hold)) if hold is not None else ""


def container_from_text(text: str) -> ContainerHold | None:
    if not text:
        return None
    fields = json.loads(text)
    return ContainerHold(**{**fields, "init": ProcessId(*fields["init"])})
