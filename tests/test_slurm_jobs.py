"""What the Slurm delegate reads of Slurm, without a cluster (brokerd/addons/slurm/jobs.py and
claims.py): `squeue --json` into jobs, a user's text kept as data (issue 31 item 2), and
which job is a request's and whether it may become a lease (issue 31 item 1); and the CLI's
age of a time to come (item 10)."""

from __future__ import annotations

import json
import re

import pytest

from brokerd.addons.slurm.claims import Claim, MarkedTwice, granted_indices
from brokerd.addons.slurm.jobs import (
    SlurmJob,
    SlurmReadError,
    gres_indices,
    parse_index_list,
    parse_jobs,
    pending_order,
)
from brokerd.leasing.errors import Internal


def _squeue_json(*jobs: dict) -> str:
    """`squeue --json` output as Slurm 22.05 prints it, for the fields vaccel reads."""
    return json.dumps({"meta": {"Slurm": {"release": "22.05.8"}}, "errors": [], "jobs": list(jobs)})


def test_gres_indices_and_squeue_json_are_read():
    assert parse_index_list("0-1,3") == (0, 1, 3)
    assert gres_indices("gpu:a100:2(IDX:0,2),gpu:1(IDX:3)", "gpu") == (0, 2, 3)
    text = _squeue_json(
        {"job_id": 7, "name": "vaccel: sh -c x", "user_name": "alice", "user_id": 1001, "job_state": "RUNNING",
         "state_reason": "None", "priority": 90, "submit_time": 1767261600, "start_time": 1767261601,
         "partition": "test", "required_nodes": "n1", "nodes": "n1", "tres_per_node": "gres:gpu:2",
         "comment": "vaccel-request:ab", "gres_detail": ["gpu:2(IDX:1-2)"],
         "job_resources": {"nodes": "n1", "allocated_nodes": [{"nodename": "n1"}]}},
        {"job_id": 8, "name": "b", "user_name": "bob", "user_id": 1002, "job_state": "PENDING",
         "state_reason": "Resources", "priority": 95, "submit_time": 1767261602, "start_time": 0,
         "partition": "test", "required_nodes": "", "nodes": "", "tres_per_node": "gres:gpu:1", "gres_detail": []})
    running, waiting = parse_jobs(text)
    assert (running.job_id, running.name, running.user, running.uid) == (7, "vaccel: sh -c x", "alice", 1001)
    assert running.holding and running.indices_on("n1") == (1, 2) and running.gpus == 2
    assert running.comment == "vaccel-request:ab" and running.start_time == 1767261601.0
    assert (waiting.state, waiting.reason, waiting.req_nodes, waiting.gpus) == ("PENDING", "Resources", "", 1)
    assert [j.job_id for j in pending_order([running, waiting], "n1")] == [8]


def test_a_job_name_or_comment_holding_fields_stays_a_name():
    """Issue 31 item 2: what a user writes in a name is never read as a job's fields."""
    forged = "x JobState=RUNNING UserId=bob(1002) Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:4(IDX:0-3) TresPerNode=gres:gpu:4"
    (job,) = parse_jobs(_squeue_json(
        {"job_id": 9, "name": forged, "comment": forged, "user_name": "alice", "user_id": 1001,
         "job_state": "PENDING", "state_reason": "BeginTime", "priority": 1, "submit_time": 100, "start_time": 400,
         "partition": "test", "required_nodes": "", "nodes": "", "tres_per_node": "gres:gpu:1", "gres_detail": []}))
    assert (job.name, job.comment, job.user, job.uid, job.state) == (forged, forged, "alice", 1001, "PENDING")
    assert not job.holding and job.gres == {} and job.gpus == 1


def test_later_slurm_json_shapes_read_too():
    (job,) = parse_jobs(_squeue_json(
        {"job_id": {"set": True, "infinite": False, "number": 5}, "name": "n", "user_name": "alice",
         "user_id": 1001, "job_state": ["RUNNING"], "state_reason": "None",
         "priority": {"set": True, "infinite": False, "number": 7}, "submit_time": {"set": True, "number": 10},
         "start_time": {"set": True, "number": 11}, "partition": "p", "nodes": "n1",
         "tres_per_node": "gres/gpu:1", "gres_detail": ["gpu:1(IDX:3)"],
         "job_resources": {"nodes": {"count": 1, "list": "n1", "allocation": [{"index": 0, "name": "n1"}]}}}))
    assert (job.job_id, job.state, job.priority, job.start_time, job.gpus) == (5, "RUNNING", 7, 11.0, 1)
    assert job.indices_on("n1") == (3,)


def test_squeue_output_that_is_not_its_json_is_an_error_not_an_empty_list():
    with pytest.raises(SlurmReadError):
        parse_jobs("JobId=7 JobName=x")
    with pytest.raises(SlurmReadError):
        parse_jobs('{"jobs": 3}')


def _job(job_id: int, uid: int, comment: str = "", **more) -> SlurmJob:
    fields = {"name": "n", "user": f"u{uid}", "state": "RUNNING", "reason": "None", "priority": 1,
              "submit_time": 1.0, "start_time": 2.0, "partition": "test", "req_nodes": "n1", "nodes": "n1",
              "gres": {"n1": (0,)}, "gpus": 1}
    fields.update(more)
    return SlurmJob(job_id=job_id, uid=uid, comment=comment, **fields)


def test_a_requests_job_is_the_one_with_its_mark_and_its_users_uid_only():
    claim = Claim("vaccel-request:m", 1001, "alice")
    assert claim.find([_job(3, 1002, "vaccel-request:m"), _job(4, 1001, "other")]) is None  # bob's copy is his
    assert claim.find([_job(3, 1002, "vaccel-request:m"), _job(5, 1001, "vaccel-request:m")]).job_id == 5
    assert claim.find([_job(5, 1001, "changed since")]).job_id == 5  # once seen, followed by its id
    with pytest.raises(MarkedTwice) as twice:
        claim.find([_job(5, 1001), _job(6, 1001, "vaccel-request:m")])
    assert twice.value.jobs == (5, 6)


def test_a_grant_needs_this_node_alone_its_partition_and_the_gpus_asked():
    here = {0, 1, 2, 3}
    grant = {"node": "n1", "partition": "test", "gres": "gpu", "gpus": 1, "indices_here": here, "taken": {9}}
    assert granted_indices(_job(5, 1001), **grant) == (0,)
    for job, words in ((_job(9, 1001), "already behind another lease"),
                       (_job(5, 1001, partition="other"), "partition 'other'"),
                       (_job(5, 1001, nodes="n[1-2]", gres={"n1": (0,), "n2": (0,)}), "not node n1 alone"),
                       (_job(5, 1001, gres={"n1": (0, 1)}), "indices [0, 1]"),
                       (_job(5, 1001, gres={"n1": (7,)}), "indices [7]")):
        with pytest.raises(Internal, match=re.escape(words)):
            granted_indices(job, **grant)


def test_the_cli_never_shows_a_negative_age(monkeypatch):
    """Issue 31 item 10, the client's side: a time to come is shown as now, never `-296s ago`."""
    from vaccel_common import status_text  # the CLI's and the broker's ready-made status alike

    monkeypatch.setattr(status_text.time, "time", lambda: 1000.0)
    assert status_text.since(1296.0).endswith("(0s ago)")
    assert status_text.since(940.0).endswith("(1m00s ago)")
