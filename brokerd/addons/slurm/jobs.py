"""What Slurm says about its jobs, as plain data: `scontrol --details --oneliner show job`
parsed into one SlurmJob per line, and the GRES indices a running job holds on a node.

Pure functions (no subprocess here: brokerd/addons/slurm/commands.py runs the programs), so the
parsing is tested on text alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

# States in which a job still holds its GRES on the node (COMPLETING: until its epilog is done).
HOLDING = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "CONFIGURING", "RESIZING"})
PENDING = "PENDING"

# `Nodes=n01 CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:0-1)`; a typed GRES reads gpu:a100:2(IDX:0,2).
_NODE_DETAIL = re.compile(r"(?:^| )Nodes=(\S+) .*?GRES=(\S*)")
_GRES_ITEM = re.compile(r"(?:^|,)([^:(,]+)(?::[^:(,]+)?(?::\d+)?\(IDX:([0-9,\-]+)\)")


@dataclass(frozen=True)
class SlurmJob:
    """One job as `scontrol show job` describes it (the fields vaccel reads)."""

    job_id: int
    name: str
    user: str
    uid: int
    state: str  # PENDING, RUNNING, COMPLETING, CANCELLED, ...
    reason: str  # why it waits: Resources, Priority, ... ("None" when it does not)
    priority: int
    submit_time: float
    start_time: float
    partition: str
    req_nodes: str  # ReqNodeList, "" = any node
    gres: dict[str, tuple[int, ...]]  # node -> the GRES indices it holds there (running jobs)
    gpus: int = 0  # GRES of our name it asks for per node (TresPerNode)

    @property
    def holding(self) -> bool:
        return self.state in HOLDING

    def indices_on(self, node: str) -> tuple[int, ...]:
        return self.gres.get(node, ())


def _time(text: str) -> float:
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:  # Unknown, None, N/A
        return 0.0


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
    """The indices of GRES `name` in a node detail's `GRES=` value: `gpu:2(IDX:0-1)` -> (0, 1)."""
    found: list[int] = []
    for item in _GRES_ITEM.finditer(gres):
        if item.group(1) == name:
            found.extend(parse_index_list(item.group(2)))
    return tuple(sorted(set(found)))


def _fields(line: str) -> dict[str, str]:
    """`Key=value` pairs of one oneliner record. Values may hold spaces (JobName=vaccel: x):
    a value runs until the next ` Key=`."""
    out: dict[str, str] = {}
    for match in re.finditer(r"(?:^| )([A-Za-z_/:]+)=(.*?)(?= [A-Za-z_/:]+=|$)", line):
        out.setdefault(match.group(1), match.group(2).strip())  # the last one ends in a space
    return out


def _asked(tres: str, name: str) -> int:
    """`gres:gpu:2` (22.05) or `gres/gpu:2` (newer) -> 2; typed `gres:gpu:a100:2` too."""
    for item in tres.split(","):
        parts = item.replace("gres/", "gres:").split(":")
        if parts[:2] == ["gres", name]:
            return int(parts[-1]) if parts[-1].isdigit() else 1
    return 0


def _user(text: str) -> tuple[str, int]:
    """`alice(1001)` -> ("alice", 1001)."""
    name, _, rest = text.partition("(")
    uid = rest.rstrip(")")
    return name, int(uid) if uid.isdigit() else -1


def parse_jobs(text: str, gres_name: str = "gpu") -> list[SlurmJob]:
    """Every job of `scontrol -d -o show job` output ("No jobs in the system" = none)."""
    jobs = []
    for line in text.splitlines():
        if not line.startswith("JobId="):
            continue
        f = _fields(line)
        user, uid = _user(f.get("UserId", ""))
        gres = {}
        for node, value in _NODE_DETAIL.findall(line):
            indices = gres_indices(value, gres_name)
            if indices:
                gres[node] = indices
        req = f.get("ReqNodeList", "(null)")
        jobs.append(SlurmJob(
            job_id=int(f["JobId"]), name=f.get("JobName", ""), user=user, uid=uid,
            state=f.get("JobState", ""), reason=f.get("Reason", "None"),
            priority=int(f.get("Priority", "0") or 0), submit_time=_time(f.get("SubmitTime", "")),
            start_time=_time(f.get("StartTime", "")), partition=f.get("Partition", ""),
            req_nodes="" if req == "(null)" else req, gres=gres, gpus=_asked(f.get("TresPerNode", ""), gres_name),
        ))
    return jobs


def wants_node(job: SlurmJob, node: str) -> bool:
    """Whether a pending job may start on `node`: it names it, or names no node at all.
    (A node range like n[01-04] is read as naming every node it might; close enough for
    a queue position, which is all this is used for.)"""
    return not job.req_nodes or node in job.req_nodes or "[" in job.req_nodes


def pending_order(jobs: list[SlurmJob], node: str) -> list[SlurmJob]:
    """The pending jobs that want `node`, in the order Slurm's priority would start them."""
    waiting = [j for j in jobs if j.state == PENDING and wants_node(j, node)]
    return sorted(waiting, key=lambda j: (-j.priority, j.submit_time, j.job_id))
