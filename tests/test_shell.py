"""`vaccel shell`: a shell inside one of your leases, against a real daemon; another real
Unix user cannot enter it (the daemon's Join checks the kernel's word for who asks)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import test_multiuser as mu
from tests.conftest import Broker

# The multi-user fixtures, shared rather than copied (module-level names pytest finds).
staged = mu.staged
root_broker = mu.root_broker


def hold_a_gpu(broker: Broker) -> tuple[subprocess.Popen[str], str]:
    """A `vaccel run` holding one device; returns it and its lease id."""
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--", "sh", "-c",
                               "echo $VACCEL_LEASE_ID; sleep 60"], env=broker.env, stdout=subprocess.PIPE, text=True)
    lease_id = holder.stdout.readline().strip() if holder.stdout else ""
    assert lease_id.startswith("l-"), "the holder printed no lease id"
    return holder, lease_id


def device_of(broker: Broker, lease_id: str) -> dict:
    return next(d for d in mu.status(broker)["devices"] if d["lease_id"] == lease_id)


def stop(holder: subprocess.Popen[str]) -> None:
    holder.terminate()
    holder.wait(timeout=15)


def test_a_shell_command_runs_inside_the_lease_as_a_member(broker: Broker):
    holder, lease_id = hold_a_gpu(broker)
    try:
        uuid = device_of(broker, lease_id)["uuid"]
        r = broker.vaccel("shell", lease_id, "-c", "echo $CUDA_VISIBLE_DEVICES $VACCEL_LEASE_ID")
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [uuid, lease_id]
        # Without an id: the caller's only lease. The shell itself is the member the broker
        # watches (it is the process that joined, same pid after the exec).
        leases = f"{broker.python} -m vaccel.cli leases --json"
        r = broker.vaccel("shell", "-c", f"echo $$; {leases}", env={**broker.env, "SHELL": "/bin/sh"})
        assert r.returncode == 0, r.stderr
        pid, listing = r.stdout.split("\n", 1)
        (lease,) = json.loads(listing)["leases"]
        assert lease["id"] == lease_id and int(pid) in lease["member_pids"]
    finally:
        stop(holder)


def test_without_an_id_a_reservation_comes_before_other_leases(broker: Broker):
    r = broker.vaccel("reserve", "--gpus", "1", "--time", "10m", "--json")
    assert r.returncode == 0, r.stderr
    reservation = json.loads(r.stdout)["lease_id"]
    holder, _ = hold_a_gpu(broker)
    try:
        r = broker.vaccel("shell", "-c", "echo $VACCEL_LEASE_ID")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == reservation
    finally:
        stop(holder)


def test_interactive_bash_keeps_the_users_rc_and_the_lease_wins(broker: Broker, tmp_path: Path):
    # A .bashrc that sets its own prompt and a device variable: it runs, the prompt gets the
    # marker in front, and the lease's devices stay the visible ones.
    (tmp_path / ".bashrc").write_text("PS1='me$ '\nexport CUDA_VISIBLE_DEVICES=all\nFROM_RC=yes\n")
    holder, lease_id = hold_a_gpu(broker)
    try:
        device = device_of(broker, lease_id)
        env = {**broker.env, "SHELL": "/bin/bash", "HOME": str(tmp_path)}
        r = broker.vaccel("shell", lease_id, env=env,
                          input='echo "prompt=[$PS1] rc=$FROM_RC devices=$CUDA_VISIBLE_DEVICES"\nexit\n')
        assert r.returncode == 0, r.stderr
        assert f"prompt=[(vaccel gpu{device['index']}) me$ ] rc=yes devices={device['uuid']}" in r.stdout
    finally:
        stop(holder)


def test_without_a_lease_it_says_how_to_get_one_and_with_several_which(broker: Broker):
    r = broker.vaccel("shell")
    assert r.returncode == 1
    assert r.stderr.startswith("vaccel: you hold no active lease")  # one line, no traceback
    assert "vaccel reserve --gpus 1 --time 2h" in r.stderr
    first, first_id = hold_a_gpu(broker)
    second, second_id = hold_a_gpu(broker)
    try:
        r = broker.vaccel("shell", "-c", "true")
        assert r.returncode == 1
        assert "name one: vaccel shell LEASE_ID" in r.stderr
        assert first_id in r.stderr and second_id in r.stderr
    finally:
        stop(first)
        stop(second)
    r = broker.vaccel("shell", first_id, "-c", "true")
    assert r.returncode == 1 and first_id in r.stderr  # ended: refused with the broker's word


@pytest.mark.multiuser
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create users")
def test_only_the_holders_user_can_enter_the_lease(root_broker: Broker, staged: Path):
    holder, lease_id = mu.alice_holds_a_gpu(root_broker, staged)
    try:
        r = mu.as_user(root_broker, staged, "vaccel-bob", "shell", lease_id, "-c", "echo inside")
        assert r.returncode == 1
        assert "inside" not in r.stdout
        assert "only its holder's processes may join it" in r.stderr
        # Her own second process may (no SHELL and a nologin account: /bin/sh runs it).
        r = mu.as_user(root_broker, staged, "vaccel-alice", "shell", lease_id, "-c", "echo $VACCEL_LEASE_ID")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == lease_id
    finally:
        holder.terminate()
        holder.wait(timeout=15)


def test_the_rcfile_quotes_what_it_exports():
    from vaccel.cli.shell import bash_rc

    rc = bash_rc({"VACCEL_LEASE_ID": "l-1", "VACCEL_PROMPT": "(vaccel gpu0) ", "VACCEL_X": "a'b $c"}, 9)
    done = subprocess.run(["bash", "-c", rc.replace("exec 9<&-", "") + 'printf "%s|%s" "$VACCEL_X" "$PS1"'],
                          env={"PATH": os.environ["PATH"], "HOME": "/nonexistent"},
                          capture_output=True, text=True, check=True)
    assert done.stdout == "a'b $c|(vaccel gpu0) $ "
