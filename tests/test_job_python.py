"""The contract's Python side is checked against the job's interpreter (vaccel/contract/job_python.py),
not the `vaccel` command's own: a lab installs vaccel in a venv without torch, and each
student runs their own venv's python.

Real interpreters throughout: this venv (it has torch), a plain `python3 -m venv` without
it (the job's, or the lab's), and a lab-like CLI venv that has everything of this one
but torch (its site-packages is a farm of links to this venv's, torch left out)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from vaccel.contract.job_python import python_at, which_python

from tests.conftest import Broker

SPEC = "dependencies:\n  - name: torch\n    version_range: 2.0,99.0\n"
SITE = Path(sysconfig.get_paths()["purelib"])  # this venv's site-packages
HAS_TORCH = sys.executable  # this venv's python: torch is a test dependency


def _venv(where: Path) -> Path:
    """A plain venv of the same base interpreter, without pip (quick): no torch."""
    subprocess.run([os.path.realpath(sys.executable), "-m", "venv", "--without-pip", str(where)], check=True,
                   timeout=300)
    return where / "bin" / "python"


def _site(venv_python: Path) -> Path:
    done = subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=120)
    return Path(done.stdout.strip())


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a job venv without torch, a CLI venv with vaccel and its dependencies but no torch)."""
    root = tmp_path_factory.mktemp("venvs")
    plain = _venv(root / "job")
    cli = _venv(root / "lab")
    site = _site(cli)
    for entry in SITE.iterdir():
        if not entry.name.lower().startswith(("torch", "functorch")):
            (site / entry.name).symlink_to(entry)
    return plain, cli


def _spec_dir(tmp_path: Path) -> Path:
    (tmp_path / "runtime-spec.yaml").write_text(SPEC)
    return tmp_path


def _cli(python: Path | str, broker: Broker, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "vaccel.cli", *args], env=broker.env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


# -- which interpreter a command runs ---------------------------------------------------------


def test_the_interpreter_a_command_runs_is_found_as_the_kernel_would(tmp_path: Path, venvs: tuple[Path, Path]):
    plain, _ = venvs
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(plain)
    path = f"{bin_dir}:/usr/bin:/bin"
    env = {"PATH": path}
    shebang_env = tmp_path / "train.py"
    shebang_env.write_text("#!/usr/bin/env python3\nprint(1)\n")
    console_script = tmp_path / "torchrun"  # as pip writes one: its venv's python, by path
    console_script.write_text(f"#!{HAS_TORCH}\nimport sys\n")
    shell = tmp_path / "job.sh"
    shell.write_text("#!/bin/sh\npython3 train.py\n")
    for script in (shebang_env, console_script, shell):
        script.chmod(0o755)
    assert which_python([HAS_TORCH, "-m", "torch.distributed.run", "x.py"], env) == HAS_TORCH
    assert which_python(["python3", "-c", "pass"], env) == str(bin_dir / "python3")  # not resolved: a venv's link
    assert which_python([str(shebang_env)], env) == str(bin_dir / "python3")
    assert which_python([str(console_script), "--nproc-per-node", "2", "x.py"], env) == HAS_TORCH
    assert which_python(["env", "OMP_NUM_THREADS=1", str(console_script)], env) == HAS_TORCH
    assert which_python([str(shell)], env) == str(bin_dir / "python3")  # else the first python3 on PATH
    assert which_python(["true"], env) == str(bin_dir / "python3")
    assert which_python(["docker", "run", "--rm", "img", "python3"], env) is None  # the image's own


def test_the_probe_says_what_a_venv_has_and_its_answer_is_kept_until_the_venv_changes(
        tmp_path: Path, venvs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch):
    plain, _ = venvs
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = python_at(str(plain), ["torch", "tinypkg"])
    assert first.facts.torch_version == "" and first.facts.python_executable == str(plain)
    assert first.said() == f"contract checked against {plain} (torch not installed)"
    assert "tinypkg" not in first.facts.packages
    assert list((tmp_path / "cache" / "vaccel" / "job-python").glob("*.json"))  # kept
    # A package installed since (as pip leaves it: a dist-info in site-packages) is seen.
    dist = _site(plain) / "tinypkg-1.2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.2\n")
    assert python_at(str(plain), ["torch", "tinypkg"]).facts.packages["tinypkg"] == "1.2"
    torch = python_at(HAS_TORCH, ["torch"])
    assert torch.facts.torch_version and torch.said().endswith(f"(torch {torch.facts.torch_version})")


# -- vaccel run and vaccel check ----------------------------------------------------------------


def test_a_lab_cli_without_torch_runs_a_job_whose_python_has_it(broker: Broker, tmp_path: Path,
                                                                venvs: tuple[Path, Path]):
    _, lab = venvs
    cwd = _spec_dir(tmp_path)
    r = _cli(lab, broker, cwd, "run", "--", HAS_TORCH, "-c", "import torch; print(torch.__version__)")
    assert r.returncode == 0, r.stderr
    import torch

    assert f"vaccel: contract checked against {HAS_TORCH} (torch {torch.__version__})\n" in r.stderr
    assert r.stdout.strip() == torch.__version__
    # A script whose shebang names the job's python.
    script = tmp_path / "train.py"
    script.write_text(f"#!{HAS_TORCH}\nimport torch\nprint('trained')\n")
    script.chmod(0o755)
    r = _cli(lab, broker, cwd, "run", "--", str(script))
    assert r.returncode == 0 and r.stdout.strip() == "trained", r.stderr
    r = _cli(lab, broker, cwd, "check", "--python", HAS_TORCH)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"Python: {sys.version.split()[0]} ({HAS_TORCH}) - OK" in r.stdout


def test_a_cli_with_torch_refuses_a_job_whose_python_lacks_it_and_names_that_python(
        broker: Broker, tmp_path: Path, venvs: tuple[Path, Path]):
    plain, _ = venvs
    cwd = _spec_dir(tmp_path)
    ran = tmp_path / "ran"
    r = _cli(HAS_TORCH, broker, cwd, "run", "--", str(plain), "-c", f"open({str(ran)!r}, 'w')")
    assert r.returncode == 1, r.stderr
    assert f"vaccel: contract checked against {plain} (torch not installed)\n" in r.stderr
    refusal = r.stderr.splitlines()[-1]
    assert f"PyTorch version: not installed in {plain}" in refusal, refusal
    assert f"{plain} -m pip install" in refusal
    assert not ran.exists(), "the command ran though its contract was refused"
    r = _cli(HAS_TORCH, broker, cwd, "check", "--python", str(plain))
    assert r.returncode == 1 and f"not installed in {plain}" in r.stdout, r.stdout + r.stderr


def test_lease_inside_a_script_keeps_its_own_interpreter(broker: Broker, tmp_path: Path, venvs: tuple[Path, Path]):
    """PATH's python3 has no torch; the script's own interpreter has: lease() checks that one."""
    plain, _ = venvs
    cwd = _spec_dir(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(plain)
    env = {**broker.env, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    code = "import vaccel\nwith vaccel.lease() as held:\n    print('held', held.id)\n"
    r = subprocess.run([HAS_TORCH, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("held l-"), r.stderr


def test_a_reservation_from_a_lab_cli_is_checked_against_the_python3_its_jobs_will_run(
        broker: Broker, tmp_path: Path, venvs: tuple[Path, Path]):
    """`vaccel reserve` has no command: its jobs' Python is the first python3 on PATH (this
    venv's, which has torch), as for `vaccel check`, not the lab CLI's own (without)."""
    import json

    _, lab = venvs
    cwd = _spec_dir(tmp_path)
    r = _cli(lab, broker, cwd, "reserve", "--json", "--time", "10m")
    assert r.returncode == 0, r.stderr
    python3 = os.path.join(os.path.dirname(HAS_TORCH), "python3")
    assert f"vaccel: contract checked against {python3} (torch " in r.stderr, r.stderr
    lease_id = json.loads(r.stdout)["lease_id"]
    assert _cli(lab, broker, cwd, "release", lease_id).returncode == 0
