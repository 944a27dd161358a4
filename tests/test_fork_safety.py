"""Forks under a lease are silent and safe: a DataLoader with fork workers inside
`with lease()` prints no gRPC fork warning, the workers never touch the parent's channel,
and the heartbeat goes on in the parent."""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from tests.conftest import Broker

pytest.importorskip("torch")

SCRIPT = textwrap.dedent("""
    import multiprocessing, os, time
    import vaccel
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    with vaccel.lease() as l:
        loader = DataLoader(data, batch_size=16, num_workers=2,
                            multiprocessing_context=multiprocessing.get_context("fork"))
        started = time.monotonic()
        batches = 0
        while time.monotonic() - started < 4:      # longer than the 3 s TTL
            for x, y in loader:
                batches += 1
        # a plain fork that uses vaccel in the child: it gets its own channel, never ours
        pid = os.fork()
        if pid == 0:
            with vaccel.lease() as child:
                os._exit(0 if child.joined and child.id == l.id else 3)
        _, code = os.waitpid(pid, 0)
        l.check()                                  # raises if the lease had expired
        print("batches", batches, "child", os.waitstatus_to_exitcode(code), flush=True)
""")


def test_dataloader_fork_workers_under_a_lease(broker: Broker):
    r = subprocess.run([broker.python, "-c", SCRIPT], env=broker.env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert words[0] == "batches" and int(words[1]) > 0
    assert words[2:] == ["child", "0"], "the forked child joined the parent's lease"
    assert "fork" not in r.stderr.lower(), f"fork warning printed: {r.stderr}"
    assert "Other threads are currently calling into gRPC" not in r.stderr


CHILD_WITHOUT_LEASE = textwrap.dedent("""
    import os, vaccel
    from vaccel.session.connection import BrokerConnection
    from vaccel_common.v1 import broker_pb2 as pb
    BrokerConnection(side_calls=False).call("Status", pb.StatusRequest())   # the parent uses gRPC
    pid = os.fork()
    if pid == 0:
        try:
            with vaccel.lease():
                os._exit(5)
        except vaccel.LeaseError as exc:
            os._exit(0 if "fork" in str(exc) else 4)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status))
""")


def test_forked_child_without_a_lease_gets_an_error_not_a_hang(broker: Broker):
    r = subprocess.run([broker.python, "-c", CHILD_WITHOUT_LEASE], env=broker.env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


def test_a_child_forked_after_only_identity_socket_calls_may_lease_on_its_own(broker: Broker):
    """Calls over the identity socket (vaccel_common/side_call.py) leave no gRPC state
    behind: a child forked after them is a fresh client, not a broken one."""
    script = CHILD_WITHOUT_LEASE.replace("BrokerConnection(side_calls=False)", "BrokerConnection()")
    script = script.replace("import os, vaccel", "import os, sys, vaccel")
    script = script.replace("    pid = os.fork()", "    assert 'grpc' not in sys.modules\n    pid = os.fork()")
    r = subprocess.run([broker.python, "-c", script], env=broker.env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "5", r.stderr  # inside its own lease
