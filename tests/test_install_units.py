"""`vaccel-brokerd install-units`: what it writes, where, and what it leaves alone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from brokerd.config.loader import load_config
from brokerd.daemon import install_units as iu
from brokerd.daemon.install_units import InstallError, install_units, render_unit

REPO = Path(__file__).resolve().parent.parent


def run_install(tmp_path: Path, **kwargs: object) -> list[Path]:
    return install_units(tmp_path / "system", config_dir=tmp_path / "etc",
                         sysusers_dir=tmp_path / "sysusers.d", **kwargs)  # type: ignore[arg-type]


def test_writes_unit_sysusers_and_config(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    written = run_install(tmp_path, exec_path="/opt/vaccel/bin/vaccel-brokerd")
    unit = tmp_path / "system" / "vaccel-brokerd.service"
    sysusers = tmp_path / "sysusers.d" / "vaccel.conf"
    config = tmp_path / "etc" / "brokerd.toml"
    dropin = tmp_path / "system" / "vaccel-brokerd.service.d" / "50-features.conf"
    assert written == [unit, sysusers, config, dropin]
    text = unit.read_text()
    assert "\nExecStart=/opt/vaccel/bin/vaccel-brokerd\n" in text
    assert "/usr/bin/vaccel-brokerd\n" not in text.replace("# ", "")
    # Everything but the executable of ExecStart= and ExecReload= is the shipped unit, byte for byte.
    shipped = (REPO / "systemd" / "vaccel-brokerd.service").read_text()
    expected = shipped.replace("ExecStart=/usr/bin/vaccel-brokerd", "ExecStart=/opt/vaccel/bin/vaccel-brokerd")
    assert text == expected.replace("ExecReload=-+/usr/bin/vaccel-brokerd",
                                    "ExecReload=-+/opt/vaccel/bin/vaccel-brokerd")
    # The example config turns on nothing that needs more than the unit: the drop-in says so.
    assert "[Service]\n\n# Nothing" in dropin.read_text()
    assert sysusers.read_text() == (REPO / "systemd" / "vaccel.sysusers").read_text()
    assert config.read_text() == (REPO / "examples" / "brokerd.toml").read_text()
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    out = capsys.readouterr().out
    assert "systemctl daemon-reload && systemctl enable --now vaccel-brokerd" in out


def test_an_existing_config_is_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "etc" / "brokerd.toml"
    config.parent.mkdir()
    config.write_text('[server]\nlog_level = "debug"\n')
    written = run_install(tmp_path, exec_path="/usr/local/bin/vaccel-brokerd")
    assert config not in written
    assert config.read_text() == '[server]\nlog_level = "debug"\n'
    assert f"kept existing {config}" in capsys.readouterr().out


def test_reinstall_replaces_the_unit(tmp_path: Path) -> None:
    run_install(tmp_path, exec_path="/a/vaccel-brokerd")
    run_install(tmp_path, exec_path="/b/vaccel-brokerd")
    text = (tmp_path / "system" / "vaccel-brokerd.service").read_text()
    assert "ExecStart=/b/vaccel-brokerd\n" in text
    assert "/a/vaccel-brokerd" not in text
    assert not list((tmp_path / "system").glob("*.tmp"))


def test_executable_is_found_beside_the_interpreter(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    exe = venv_bin / "vaccel-brokerd"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python3"))
    run_install(tmp_path)
    assert f"\nExecStart={exe}\n" in (tmp_path / "system" / "vaccel-brokerd.service").read_text()


def test_executable_is_found_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "vaccel-brokerd"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "nowhere" / "python3"))
    monkeypatch.setenv("PATH", str(bin_dir))
    assert iu.find_executable() == str(exe)


def test_no_executable_anywhere_is_an_error(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InstallError, match="cannot find the vaccel-brokerd executable"):
        run_install(tmp_path)
    assert not (tmp_path / "system").exists()


@pytest.mark.parametrize("bad", ["vaccel-brokerd", "bin/vaccel-brokerd", "/opt/my venv/x"])
def test_exec_path_must_be_absolute_without_spaces(bad: str) -> None:
    with pytest.raises(InstallError):
        render_unit("ExecStart=/usr/bin/vaccel-brokerd\n", bad)


def test_sysusers_runs_only_for_the_system_directory(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(iu.subprocess, "run", lambda cmd, **_: ran.append(cmd))
    run_install(tmp_path, exec_path="/x/vaccel-brokerd")
    assert ran == []
    if os.geteuid() == 0 and iu.shutil.which("systemd-sysusers"):
        monkeypatch.setattr(iu, "_SYSTEM_SYSUSERS_DIR", tmp_path / "sysusers.d")
        run_install(tmp_path, exec_path="/x/vaccel-brokerd")
        assert ran and ran[0][-1] == str(tmp_path / "sysusers.d" / "vaccel.conf")


def test_example_config_loads(tmp_path: Path) -> None:
    config = load_config(REPO / "examples" / "brokerd.toml")
    assert config.socket == Path("/run/vaccel/brokerd.sock")
    assert config.state_dir == Path("/var/lib/vaccel")
    assert config.inventory is None
    assert config.admin_group == "vaccel-admin"
    assert config.heartbeat_ttl_s == 30
    assert config.max_lease_duration_s == 7 * 86400
    assert config.unleased_processes == "report"
    # The commented inventory line is the one the docs tell an admin to enable.
    enabled = tmp_path / "brokerd.toml"
    enabled.write_text((REPO / "examples" / "brokerd.toml").read_text()
                       .replace("# inventory = ", "inventory = "))
    assert load_config(enabled).inventory == Path("/etc/vaccel/inventory.yaml")


def test_the_command_refuses_a_unit_for_code_that_runs_from_a_checkout(tmp_path: Path) -> None:
    # These tests run from the checkout (the development venv's editable install): a service
    # installed from it would run whatever this clone holds. The lab's install is a wheel in
    # its own venv (scripts/install.sh, `sudo make install`; the boot test runs it).
    assert iu.running_checkout() == REPO
    r = subprocess.run([sys.executable, "-m", "brokerd", "install-units", "--dest", str(tmp_path / "system")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith(f"vaccel-brokerd: this vaccel-brokerd runs from the source checkout {REPO} "), r.stderr
    assert "`sudo make install`" in r.stderr and "--from-checkout" in r.stderr
    assert not (tmp_path / "system").exists()
