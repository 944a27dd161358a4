"""The state directory's disk full (issue 46): the broker refuses new grants with the reason,
keeps serving everything else, loses no ended lease's accounting row (the rows it could
not write are kept in memory and written once the disk takes them), and grants again as
soon as there is room. A real daemon on a small tmpfs that a file fills and then frees."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from vaccel.session.outcome import EXIT_UNAVAILABLE

from tests.test_broker_integration import leased, status, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs for the state directory")


@pytest.fixture
def small_state_dir():
    workdir = Path(tempfile.mkdtemp(prefix="vaccel-full-"))
    state = workdir / "state"
    state.mkdir(mode=0o700)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(state)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield workdir
    subprocess.run(["umount", "-l", str(state)], check=False)
    shutil.rmtree(workdir, ignore_errors=True)


def reported(broker) -> list[str]:
    r = broker.vaccel("report", "--by", "lease", "--json")
    assert r.returncode == 0, r.stderr
    return [row["key"] for row in json.loads(r.stdout)["rows"]]


def lease_id(run: subprocess.CompletedProcess[str]) -> str:
    return run.stderr.split("lease ", 1)[1].split(":", 1)[0]


def test_a_full_disk_refuses_grants_with_the_reason_and_loses_no_ended_lease(start_broker, small_state_dir):
    broker = start_broker(workdir=small_state_dir)
    filler = broker.state_dir / "filler"
    # The first lease's command fills the disk: its end (and its accounting row) meet a full disk.
    first = broker.vaccel("run", "--", "sh", "-c", f"dd if=/dev/zero of={filler} bs=64k 2>/dev/null; true")
    assert first.returncode == 0, first.stderr
    refused = broker.vaccel("run", "--no-wait", "--", "true")
    # 69, unavailable for now (EX_UNAVAILABLE): it passes, unlike a refusal (1).
    assert refused.returncode == EXIT_UNAVAILABLE and "disk is full" in refused.stderr, refused.stderr
    status = broker.vaccel("status", "--json")
    assert status.returncode == 0 and all(d["state"] == "free" for d in json.loads(status.stdout)["devices"])
    # One that waits is told why and asks again until the disk has room (its job is not lost).
    waiting = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "true"], env=broker.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    told = waiting.stderr.readline()
    assert "disk is full" in told and "asking again" in told, told

    filler.unlink()
    assert waiting.wait(timeout=60) == 0, waiting.stderr.read()
    again = broker.vaccel("run", "--", "true")
    assert again.returncode == 0, again.stderr
    wanted = {lease_id(first), lease_id(again)}
    wait_for(lambda: wanted <= set(reported(broker)), timeout=60)
    assert broker.proc.poll() is None
    # Its end reached the disk: a restart brings no ended lease back.
    broker.stop()
    broker.start()
    status = json.loads(broker.vaccel("status", "--json").stdout)
    assert all(d["state"] == "free" for d in status["devices"]), status["devices"]
    assert wanted <= set(reported(broker))


def test_a_grant_the_full_disk_refused_leaves_no_request_behind_for_a_restart(start_broker, small_state_dir):
    """A waiter whose grant could not be recorded asks again under its key and gets a lease
    of its own. The request the refused grant was for must not come back at the next
    restart as a second request of the same live client: granted to nobody, its lease would
    expire unheard and the reaper SIGTERM that client (issue 46's faulted day lost every
    job of a user's driver so)."""
    broker = start_broker(workdir=small_state_dir)
    first_done, second_done = small_state_dir / "first-done", small_state_dir / "second-done"

    def run_until(done: Path) -> subprocess.Popen[str]:
        return subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--gpus", "4", "--", "sh", "-c",
                                 f"while [ ! -e {done} ]; do sleep 0.05; done"],
                                env=broker.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    holder = run_until(first_done)
    wait_for(lambda: len(leased(broker)) == 4)
    waiter = run_until(second_done)
    try:
        wait_for(lambda: status(broker)["queue"])  # on disk before its waiter hears its place
        filler = broker.state_dir / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)
        first_done.touch()
        assert holder.wait(timeout=60) == 0, holder.stderr.read()
        told = ""
        while "disk is full" not in told:  # its grant met the full disk: it asks again
            told = waiter.stderr.readline()
            assert told, "the waiter ended without hearing of the full disk"
        filler.unlink()
        wait_for(lambda: len(leased(broker)) == 4 and not status(broker)["queue"])  # the waiter holds them
        broker.kill9()
        broker.start()
        assert status(broker)["queue"] == [], "the refused grant's request came back from the disk"
        second_done.touch()
        assert waiter.wait(timeout=60) == 0, waiter.stderr.read()
        assert not leased(broker)
    finally:
        for proc in (holder, waiter):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
