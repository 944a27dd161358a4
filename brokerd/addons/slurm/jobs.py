"""What Slurm says about its jobs, as plain data: `squeue --json` read into one SlurmJob per
job, and the GRES indices a running job holds on a node.

Slurm's JSON and nothing else: a job's name and comment are the user's own text, and in
`scontrol`'s `Key=value` lines a name such as `x JobState=RUNNING Nodes=n1 GRES=gpu:4(IDX:0-3)`
read as fields of its own (issue 31). Here every field is a JSON value, each user-set one
is kept as data. The shapes are those of Slurm 22.05 (openapi v0.0.38, Debian 12); the
later ones (a state as a list, numbers as {"set", "number"}, nodes under
job_resources.nodes.allocation) read too.

Pure functions (no subprocess here: brokerd/addons/slurm/commands.py runs the programs), so the
parsing is tested on text alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# States in which a job still holds its GRES on the node (COMPLETING: until its epilog is done).
HOLDING = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "CONFIGURING", "RESIZING"})
# States in which a job's allocation is granted and in use: what a grant may be made on.
STARTED = frozenset({"RUNNING", "CONFIGURING"})
PENDING = "PENDING"

# One node's GRES detail: `gpu:2(IDX:0-1)`; a typed GRES reads gpu:a100:2(IDX:0,2).
_GRES_ITEM = re.compile(r"(?:^|,)([^:(,]+)(?::[^:(,]+)?(?::\d+)?\(IDX:([0-9,\-]+)\)")


class SlurmReadError(ValueError):
    """squeue's output is not the JSON this reads."""


@dataclass(frozen=True)
class SlurmJob:
    """One job as `squeue --json` describes it (the fields vaccel reads)."""

    job_id: int
    name: str  # the user's text
    user: str
    uid: int
    state: str  # PENDING, RUNNING, COMPLETING, CANCELLED, ...
    reason: str  # why it waits: Resources, Priority, ... ("None" when it does not)
    priority: int
    submit_time: float
    start_time: float  # a pending job's is when Slurm plans to start it, if at all
    partition: str
    req_nodes: str  # the nodes it asked for, "" = any node
    nodes: str  # the nodes it holds, "" while pending
    gres: dict[str, tuple[int, ...]]  # node -> the GRES indices it holds there (running jobs)
    gpus: int = 0  # GRES of our name it asks for per node (tres_per_node)
    comment: str = ""  # the user's text too (vaccel puts its request's mark here)

    @property
    def holding(self) -> bool:
        return self.state in HOLDING

    def indices_on(self, node: str) -> tuple[int, ...]:
        return self.gres.get(node, ())


def parse_index_list(text: str) -> tuple[int, ...]:
    """`0-1,3` -> (0, 1, 3)."""
    out: list[int] = []
    for part in text.split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return tuple(out)


def gres_indices(gres: str, name: str) -> tuple[int, ...]:
    """The indices of GRES `name` in one node's GRES detail: `gpu:2(IDX:0-1)` -> (0, 1)."""
    found: list[int] = []
    for item in _GRES_ITEM.finditer(gres):
        if item.group(1) == name:
            found.extend(parse_index_list(item.group(2)))
    return tuple(sorted(set(found)))


def _asked(tres: str, name: str) -> int:
    """`gres:gpu:2` (22.05) or `gres/gpu:2` (newer) -> 2; typed `gres:gpu:a100:2` too."""
    for item in tres.split(","):
        parts = item.replace("gres/", "gres:").split(":")
        if parts[:2] == ["gres", name]:
            return int(parts[-1]) if parts[-1].isdigit() else 1
    return 0


def _number(value: Any) -> int:
    """22.05's plain number, or a later {"set": true, "number": N}; 0 when unset."""
    if isinstance(value, dict):
        value = value.get("number", 0) if value.get("set", True) and not value.get("infinite") else 0
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _text(value: Any) -> str:
    """A string field; a later list of them (job_state) reads as its first."""
    if isinstance(value, list):
        value = value[0] if value else ""
    return value if isinstance(value, str) else ""


def _allocated_nodes(job: dict[str, Any]) -> list[str]:
    """The job's nodes in the order of its gres_detail entries."""
    resources = job.get("job_resources") or {}
    if isinstance(resources.get("allocated_nodes"), list):  # 22.05, 23.02
        return [_text(n.get("nodename")) for n in resources["allocated_nodes"] if isinstance(n, dict)]
    nodes = resources.get("nodes")
    if isinstance(nodes, dict) and isinstance(nodes.get("allocation"), list):  # 23.11 and later
        return [_text(n.get("name")) for n in nodes["allocation"] if isinstance(n, dict)]
    return []


def _job(raw: dict[str, Any], gres_name: str) -> SlurmJob:
    details = [d for d in raw.get("gres_detail") or [] if isinstance(d, str)]
    gres = {}
    for node, detail in zip(_allocated_nodes(raw), details, strict=False):
        indices = gres_indices(detail, gres_name)
        if node and indices:
            gres[node] = indices
    return SlurmJob(
        job_id=_number(raw.get("job_id")), name=_text(raw.get("name")), user=_text(raw.get("user_name")),
        uid=_number(raw.get("user_id")) if "user_id" in raw else -1, state=_text(raw.get("job_state")),
        reason=_text(raw.get("state_reason")) or "None", priority=_number(raw.get("priority")),
        submit_time=float(_number(raw.get("submit_time"))), start_time=float(_number(raw.get("start_time"))),
        partition=_text(raw.get("partition")), req_nodes=_text(raw.get("required_nodes")),
        nodes=_text(raw.get("nodes")), gres=gres, gpus=_asked(_text(raw.get("tres_per_node")), gres_name),
        comment=_text(raw.get("comment")),
    )


def parse_jobs(text: str, gres_name: str = "gpu") -> list[SlurmJob]:
    """Every job of `squeue --json` output; SlurmReadError when it is not that."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise SlurmReadError(f"squeue --json printed no JSON: {exc}") from None
    jobs = document.get("jobs") if isinstance(document, dict) else None
    if not isinstance(jobs, list):
        raise SlurmReadError("squeue --json printed no list of jobs")
    return [_job(raw, gres_name) for raw in jobs if isinstance(raw, dict) and _number(raw.get("job_id"))]


def wants_node(job: SlurmJob, node: str) -> bool:
    """Whether a pending job may start on `node`: it names it, or names no node at all.
    (A node range like n[01-04] is read as naming every node it might; close enough for
    a queue position, which is all this is used for.)"""
    return not job.req_nodes or node in job.req_nodes.split(",") or "[" in job.req_nodes


def pending_order(jobs: list[SlurmJob], node: str) -> list[SlurmJob]:
    """The pending jobs that want `node`, in the order Slurm's priority would start them."""
    waiting = [j for j in jobs if j.state == PENDING and wants_node(j, node)]
    return sorted(waiting, key=lambda j: (-j.priority, j.submit_time, j.job_id))
