"""The demo's students: real Unix users when the demo runs as root, one user otherwise.

Each student runs the same interpreter on a world-readable copy of the sources (the
checkout may sit under /root, mode 0700, where no other user can read it). Users the
demo creates are removed when it ends; users that already existed are left alone.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "demo-"
PACKAGES = (ROOT / "client" / "vaccel", ROOT / "vaccel_common", ROOT / "brokerd", ROOT / "examples")


class Cast:
    """Who runs the students' commands, and with what environment."""

    def __init__(self, names: list[str]) -> None:
        self.real_users = os.geteuid() == 0
        self.names = names
        self._created: list[str] = []
        self.stage = Path(tempfile.mkdtemp(prefix="vaccel-demo-src-"))

    def __enter__(self) -> Cast:
        os.chmod(self.stage, 0o755)
        for package in PACKAGES:
            shutil.copytree(package, self.stage / package.name, ignore=shutil.ignore_patterns("__pycache__"))
        for path in self.stage.rglob("*"):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        if self.real_users:
            for name in self.names:
                self._ensure_user(self.user(name))
        return self

    def __exit__(self, *exc: object) -> None:
        for user in self._created:
            subprocess.run(["userdel", user], capture_output=True)
        shutil.rmtree(self.stage, ignore_errors=True)

    def _ensure_user(self, user: str) -> None:
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", user], check=True)
            self._created.append(user)

    def user(self, name: str) -> str:
        """The Unix user a student runs as (everyone is this process's user when not root)."""
        return f"{PREFIX}{name}" if self.real_users else pwd.getpwuid(os.getuid()).pw_name

    def popen_args(self, name: str, socket: Path) -> dict[str, object]:
        """subprocess arguments that run a command as student `name` against the broker."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "VACCEL_SOCKET": str(socket),
               "PYTHONPATH": str(self.stage), "PYTHONUNBUFFERED": "1", "HOME": str(self.stage),
               "LANG": os.environ.get("LANG", "C.UTF-8")}
        args: dict[str, object] = {"env": env, "cwd": self.stage}
        if self.real_users:
            args["user"] = self.user(name)
        return args
