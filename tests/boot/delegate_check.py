"""Slurm delegate mode's needs, checked under the shipped unit's sandbox (run by the boot
test's copy of vaccel-brokerd.service, with or without the drop-in the daemon writes for
`[slurm] mode = "delegate"`): what the daemon's own detection says, then the two things the
mode does, for real: run a command as a user the way the delegate runs salloc (setpriv
--reuid --regid --init-groups) and reach a TCP port (slurmctld's; here the dashboard's).

    delegate_check.py USER PORT     prints one line per check; exit 0 when all work
"""

from __future__ import annotations

import socket
import subprocess
import sys

from brokerd.config.loader import Config
from brokerd.daemon.unit_needs import blocks, needs

user, port = sys.argv[1], int(sys.argv[2])
(need,) = [n for n in needs(Config(slurm_mode="delegate")) if n.feature == "slurm.mode"]
blocked = blocks(need)
print(f"detected: {blocked}")
run = subprocess.run(["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "id", "-un"],
                     capture_output=True, text=True, timeout=30)
as_user = run.stdout.strip() == user
print(f"as {user}: {run.stdout.strip() or run.stderr.strip()}")
try:
    socket.create_connection(("127.0.0.1", port), timeout=10).close()
    tcp = "connected"
except OSError as exc:
    tcp = f"{type(exc).__name__}: {exc}"
print(f"tcp 127.0.0.1:{port}: {tcp}")
sys.exit(0 if as_user and tcp == "connected" and not blocked else 1)
