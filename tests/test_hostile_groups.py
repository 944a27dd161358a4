"""Limits follow the user, not the process's gid (issue 31 item 6): alice is limited through
her primary group; `sg` to another group of hers used to make her a stranger to the policy
(3 of 4 GPUs taken). Real users, a real daemon as root, the real `sg`.

Also `vaccel report --by group`: a lease counts under the policy group that applied to its
user, not under whatever gid the process had (item 6's second half, issue 33 item 9).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LAB_INVENTORY, Broker
from tests.test_hostile import bob_gets_a_gpu
from tests.test_multiuser import _ensure_group, staged, status, wait_for  # noqa: F401 - staged: a fixture

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: useradd, groupadd, a daemon as root"),
]

ALICE = "vaccel-alice"
OTHER = "vaccel-t-other"  # a second group of alice's, with no table in the policy


@pytest.fixture
def limited(staged: Path, start_broker) -> Iterator[Broker]:  # noqa: F811 - staged: a fixture
    """4 GPUs; alice's primary group (her user private group) may hold 1 at once."""
    _ensure_group(OTHER, [ALICE])
    primary = grp.getgrgid(pwd.getpwnam(ALICE).pw_gid).gr_name
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-g-"))
    os.chmod(workdir, 0o755)
    config = f'[leases]\nheartbeat_ttl = "5s"\n[policy.group.{primary}]\nmax_devices = 1\n'
    broker = start_broker(LAB_INVENTORY, config, workdir=workdir)
    yield broker
    broker.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def as_alice_in(group: str | None, broker: Broker, staged: Path, *args: str,  # noqa: F811 - staged: a fixture
                popen: bool = False):
    """`vaccel ARGS` as alice with her own groups only, under `sg GROUP` when one is given."""
    env = {"PATH": "/usr/bin:/bin", "VACCEL_SOCKET": str(broker.socket), "PYTHONPATH": str(staged),
           "HOME": "/", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "vaccel.cli", *args]
    if group is not None:
        command = ["sg", group, "-c", shlex.join(command)]
    kwargs = {"user": ALICE, "group": pwd.getpwnam(ALICE).pw_gid, "extra_groups": [], "env": env, "cwd": "/",
              "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    if popen:
        return subprocess.Popen(command, **kwargs)
    return subprocess.run(command, timeout=60, **kwargs)


def test_a_user_limited_through_a_group_stays_limited_under_sg(limited: Broker, staged: Path):  # noqa: F811
    primary = grp.getgrgid(pwd.getpwnam(ALICE).pw_gid).gr_name
    holder = as_alice_in(None, limited, staged, "run", "--", "sleep", "60", popen=True)
    try:
        wait_for(lambda: sum(d["state"] == "leased" for d in status(limited)["devices"]) == 1)
        # The escape: the same user, with another of her groups as the process's gid.
        more = as_alice_in(OTHER, limited, staged, "run", "--no-wait", "--", "true")
        assert more.returncode != 0, more.stdout
        assert f"max_devices=1 for group {primary}" in more.stderr, more.stderr
        greedy = as_alice_in(OTHER, limited, staged, "run", "--gpus", "3", "--no-wait", "--", "true")
        assert greedy.returncode != 0 and f"for group {primary}" in greedy.stderr, greedy.stderr
        assert sum(d["state"] == "leased" for d in status(limited)["devices"]) == 1
        bob_gets_a_gpu(limited, staged)  # and everyone else is served meanwhile
        usage = {u["user"]: u for u in status(limited)["usage"]}
        assert usage[ALICE]["policy"] == f"group {primary}"
    finally:
        holder.terminate()
        holder.wait(10)


def test_report_by_group_counts_a_lease_under_the_policy_group(limited: Broker, staged: Path):  # noqa: F811
    primary = grp.getgrgid(pwd.getpwnam(ALICE).pw_gid).gr_name
    ran = as_alice_in(OTHER, limited, staged, "run", "--no-wait", "--", "true")  # within her limit
    assert ran.returncode == 0, ran.stderr
    # Its row is written when the lease ends, on the accounting's own thread.
    rows = wait_for(lambda: json.loads(limited.vaccel("report", "--by", "group", "--json").stdout)["rows"])
    assert [(row["key"], row["leases"]) for row in rows] == [(primary, 1)], rows
