"""`vaccel-brokerd install-units`: put the systemd unit, the sysusers.d snippet and an
example configuration where systemd and the broker look for them.

The shipped unit says `ExecStart=/usr/bin/vaccel-brokerd`; pip rarely installs there (a venv,
/usr/local/bin, ~/.local/bin), so the installed copy names the executable that is really
there. Files come from the source checkout when running from one, else from the copies
the wheel installs under `<prefix>/share/vaccel/`. The command line refuses to install a
unit for code that runs from a checkout (`running_checkout`) unless told to: the lab's
install is a wheel in a venv of its own (scripts/install.sh).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from brokerd.config.loader import ConfigError, load_config
from brokerd.daemon.unit_needs import DROPIN, write_dropin, write_readable

UNIT_NAME = "vaccel-brokerd.service"
SYSUSERS_NAME = "vaccel.conf"
CONFIG_NAME = "brokerd.toml"
NEXT_STEP = "systemctl daemon-reload && systemctl enable --now vaccel-brokerd"
_SYSTEM_SYSUSERS_DIR = Path("/etc/sysusers.d")

# (name in the checkout, name under share/vaccel)
_SOURCES = {
    "unit": (Path("systemd") / UNIT_NAME, Path("systemd") / UNIT_NAME),
    "sysusers": (Path("systemd") / "vaccel.sysusers", Path("systemd") / "vaccel.sysusers"),
    "config": (Path("examples") / CONFIG_NAME, Path("examples") / CONFIG_NAME),
}


class InstallError(RuntimeError):
    """Installing cannot go on; the message says what is missing and what to do."""


def _source(kind: str) -> Path:
    in_checkout, in_share = _SOURCES[kind]
    candidates = [
        Path(__file__).resolve().parents[2] / in_checkout,  # brokerd/daemon/ in a checkout
        Path(sys.prefix) / "share" / "vaccel" / in_share,
    ]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    raise InstallError(f"cannot find the packaged {kind} file (looked in {looked}); "
                       "reinstall vaccel or run from a source checkout")


def running_checkout() -> Path | None:
    """The source checkout this code runs from (an editable development install), or None
    for an installed copy. A service must not run from a checkout: it would run whatever
    that clone holds at the moment, and stop when the clone goes."""
    root = Path(__file__).resolve().parents[2]  # brokerd/daemon/ in a checkout
    return root if (root / "pyproject.toml").is_file() and (root / "client" / "vaccel").is_dir() else None


def checkout_refusal(checkout: Path) -> str:
    return (f"this vaccel-brokerd runs from the source checkout {checkout} (a development install): a service "
            "installed from it would run whatever that clone holds and stop when it goes. Install the lab's copy "
            "with `sudo make install` in a checkout (scripts/install.sh: a wheel into /opt/vaccel, which runs "
            "install-units itself), or pass --from-checkout to install this one anyway")


def find_executable() -> str:
    """The vaccel-brokerd of this installation: beside the running interpreter (a venv's
    bin/, which need not be on PATH), else the first on PATH."""
    beside = Path(sys.executable).parent / "vaccel-brokerd"
    if os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("vaccel-brokerd")
    if on_path:
        return os.path.abspath(on_path)
    raise InstallError("cannot find the vaccel-brokerd executable beside "
                       f"{sys.executable} or on PATH; pass its path explicitly")


def render_unit(text: str, exec_path: str) -> str:
    """The unit text with ExecStart= naming `exec_path` (absolute, as systemd requires)."""
    if not os.path.isabs(exec_path):
        raise InstallError(f"ExecStart needs an absolute path, not {exec_path!r}")
    if re.search(r"\s", exec_path):
        raise InstallError(f"the executable path must not contain whitespace: {exec_path!r}")
    rendered, count = re.subn(r"(?m)^ExecStart=\S+", lambda _: f"ExecStart={exec_path}", text)
    if count != 1:
        raise InstallError(f"the packaged unit has {count} ExecStart= lines, expected 1")
    # ExecReload= runs the same executable (write-unit-dropin), behind its prefixes.
    return re.sub(r"(?m)^(ExecReload=[-+@!:]*)/usr/bin/vaccel-brokerd\b", lambda m: m[1] + exec_path, rendered)


def install_units(
    dest: Path = Path("/etc/systemd/system"),
    *,
    exec_path: str | None = None,
    config_dir: Path = Path("/etc/vaccel"),
    sysusers_dir: Path = _SYSTEM_SYSUSERS_DIR,
    root: Path = Path("/"),
) -> list[Path]:
    """Install the unit into `dest`, the sysusers.d snippet into `sysusers_dir` and, when
    `config_dir` has no brokerd.toml yet, the documented example configuration; then the
    drop-in with what that configuration's features need (folders it opens made under `root`).

    Returns the files written. An existing configuration is never overwritten. When the
    snippet lands in the system's /etc/sysusers.d, systemd-sysusers runs so that the
    vaccel-admin group exists right away. Prints the next step for the admin.
    """
    exe = exec_path if exec_path is not None else find_executable()
    written = [
        write_readable(dest / UNIT_NAME, render_unit(_source("unit").read_text(), exe)),
        write_readable(sysusers_dir / SYSUSERS_NAME, _source("sysusers").read_text()),
    ]
    config = config_dir / CONFIG_NAME
    if not config.exists():
        written.append(write_readable(config, _source("config").read_text()))
    # What the configured features need beyond the unit (brokerd/daemon/unit_needs.py).
    dropin = dest / f"{UNIT_NAME}.d" / DROPIN.name
    try:
        write_dropin(load_config(config, {}), dropin, root=root)
        written.append(dropin)
    except ConfigError as exc:
        print(f"no drop-in written: {exc}; fix it, then run `vaccel-brokerd write-unit-dropin`")
    for path in written:
        print(f"installed {path}")
    if config not in written:
        print(f"kept existing {config}")
    sysusers = shutil.which("systemd-sysusers")
    if sysusers_dir == _SYSTEM_SYSUSERS_DIR and sysusers and os.geteuid() == 0:
        subprocess.run([sysusers, str(written[1])], check=True)
        print("created the vaccel-admin group (systemd-sysusers)")
    print(f"next: {NEXT_STEP}")
    return written
