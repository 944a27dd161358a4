"""What `vaccel run` settles before it asks the broker (issue 33, items 4 and 5): the command
is found on the PATH it will get (a typo exits 127 at once, not after the wait and the
grant), and the contract files it read are named in one line and in every refusal; the
project's own example contract is satisfiable by its own set-up. Against a real daemon."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from vaccel.run.command_path import CommandNotFound, find_command

from tests.conftest import ROOT, Broker
from tests.test_broker_integration import leased, status, wait_for


def hold_every_device(broker: Broker) -> subprocess.Popen:
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--gpus", "4", "--", "sleep", "60"],
                              env=broker.env, stderr=subprocess.DEVNULL)
    wait_for(lambda: len(leased(broker)) == 4)
    return holder


def test_a_mistyped_command_is_said_at_once_even_when_every_device_is_taken(broker: Broker, tmp_path: Path):
    holder = hold_every_device(broker)
    try:
        # Before, this waited its whole --wait in the queue (then 75); with a free device it
        # took the lease and exited 127 only after the grant.
        r = broker.vaccel("run", "--wait", "20s", "--", "no-such-command-xyz", "--flag")
        assert r.returncode == 127, r.stderr
        assert r.stderr == "vaccel: no-such-command-xyz: command not found (nothing was leased)\n"
        script = tmp_path / "job.sh"
        script.write_text("#!/bin/sh\necho hi\n")  # not executable
        r = broker.vaccel("run", "--wait", "20s", "--", str(script))
        assert r.returncode == 126 and "is not executable" in r.stderr, r.stderr
        assert not status(broker)["queue"]
    finally:
        holder.terminate()
        holder.wait(10)
    ended = broker.vaccel("leases", "--ended", "--json").stdout
    assert "no-such-command-xyz" not in ended and "job.sh" not in ended  # never leased


def test_the_command_is_looked_up_as_the_shell_does(tmp_path: Path):
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert find_command("tool", path=f"/nonexistent:{tmp_path}") == str(tool)
    assert find_command(str(tool)) == str(tool)
    assert find_command("sh") == shutil.which("sh")
    with pytest.raises(CommandNotFound) as missing:
        find_command("tool", path="/nonexistent")
    assert missing.value.exit_code == 127
    with pytest.raises(CommandNotFound) as folder:
        find_command(str(tmp_path))
    assert folder.value.exit_code == 126 and "is a directory" in str(folder.value)


def test_the_contract_files_read_are_said_in_one_line(broker: Broker, tmp_path: Path):
    shutil.copy(ROOT / "examples" / "runtime-spec.yaml", tmp_path / "runtime-spec.yaml")
    r = broker.vaccel("run", "--", "true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr  # the example is satisfiable by the project's own set-up
    lines = r.stderr.splitlines()
    assert lines[0] == "vaccel: contract files read: runtime-spec.yaml (found in the working directory)"
    assert sum("contract files read" in line for line in lines) == 1
    quiet = broker.vaccel("run", "--quiet", "--", "true", cwd=tmp_path)
    assert quiet.returncode == 0 and "contract files" not in quiet.stderr


def test_a_refusal_names_the_contract_file_it_came_from(broker: Broker, tmp_path: Path):
    (tmp_path / "runtime-spec.yaml").write_text("required_features:\n  - gpu_compute_capability: sm_90\n")
    r = broker.vaccel("run", "--", "true", cwd=tmp_path)  # queued, it would never be answered: no sm_90 here
    assert r.returncode == 1
    assert r.stderr.startswith("vaccel: contract files read: runtime-spec.yaml (found in the working directory)\n")
    refusal = r.stderr.splitlines()[-1]
    assert "required sm_90" in refusal and refusal.endswith("(contract: runtime-spec.yaml)"), refusal
    r = broker.vaccel("reserve", "--contract", "runtime-spec.yaml", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.splitlines()[-1].endswith("(contract: runtime-spec.yaml)"), r.stderr


def test_the_example_contract_is_satisfiable_by_the_projects_own_set_up(broker: Broker):
    pytest.importorskip("torch")
    r = broker.vaccel("check", str(ROOT / "examples" / "runtime-spec.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Result: satisfiable" in r.stdout
    assert r.stderr.startswith("vaccel: contract files read: ") and r.stderr.splitlines()[0].endswith(
        "examples/runtime-spec.yaml (as named)"), r.stderr
    assert r.stderr.splitlines()[1].startswith("vaccel: contract checked against "), r.stderr
