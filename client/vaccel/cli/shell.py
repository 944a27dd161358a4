"""`vaccel shell [LEASE_ID] [-c COMMAND]`: your shell ($SHELL) inside one of your leases.

    vaccel reserve --gpus 1 --time 2h
    vaccel shell                         # (vaccel gpu0) $ python train.py
    vaccel shell l-3f2a -c 'python check_devices.py'

This process joins the lease (the broker checks the kernel's word that it is the lease
holder's user: nobody else may), then replaces itself with the shell: the member the
broker watches is the shell itself, same pid, and what the shell starts is inside the
lease. The shell gets our environment with only the lease's devices visible (as `vaccel
run` gives its command), plus VACCEL_LEASE_ID.

Interactive bash gets the prompt marker through an rcfile that first reads the usual
/etc/bash.bashrc and ~/.bashrc, then sets the lease's variables again (a .bashrc that
sets a device variable must not undo the lease) and puts "(vaccel gpu0) " before PS1;
the user's files are left untouched. Not a login shell (-l): the environment is already
the login's, and profile scripts would run a second time. Other shells get the marker in
PS1 from the environment (sh/dash use it; zsh and fish keep their own prompt, and can show
$VACCEL_PROMPT).
"""

from __future__ import annotations

import argparse
import os
import pwd
import shlex
import time
from typing import Any

NO_LEASE = ("you hold no active lease; reserve one with `vaccel reserve --gpus 1 --time 2h`, "
            "then run `vaccel shell`")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("shell", parents=[common], help="a shell inside one of your leases",
                       description="Start your shell ($SHELL) with a lease's devices visible and a prompt "
                                   "marker. Without LEASE_ID: your only active lease (a reservation if you "
                                   "hold one). Only the lease holder's own user may enter it.",
                       epilog="example: vaccel reserve --gpus 1 --time 2h && vaccel shell")
    p.add_argument("lease_id", nargs="?", metavar="LEASE_ID", help="as `vaccel leases` shows it")
    p.add_argument("-c", dest="shell_command", metavar="COMMAND", help="run COMMAND in the shell and exit")
    p.set_defaults(func=cmd_shell)


def cmd_shell(args: argparse.Namespace) -> int:
    from vaccel.cli import common as cli
    from vaccel.session.lease import Lease
    from vaccel_common.v1 import broker_pb2 as pb

    conn = cli.connection(args)
    lease_id = args.lease_id or pick_lease(cli.rpc(conn, "ListLeases", pb.ListLeasesRequest()).leases)
    held = Lease(cli.rpc(conn, "Join", pb.LeaseRef(lease_id=lease_id)), joined=True)
    conn.close()  # its socket is close-on-exec; the channel's threads end with the exec
    shell = login_shell()
    env = shell_env(held, shell)
    argv = shell_argv(shell, args.shell_command, env)
    try:
        os.execve(shell, argv, env)
    except OSError as exc:
        raise cli.CliError(f"cannot start {shell}: {exc.strerror}", 127 if isinstance(exc, FileNotFoundError)
                           else 126) from None
    return 0  # not reached


def pick_lease(leases: Any) -> str:
    """The lease to enter when none is named: the one this process already runs inside,
    else the only reservation, else the only lease; several: say which there are."""
    from vaccel.cli import common as cli

    active = [lease for lease in leases if lease.state == "active"]
    inherited = os.environ.get("VACCEL_LEASE_ID", "")
    if any(lease.id == inherited for lease in active):
        return inherited
    if not active:
        raise cli.CliError(NO_LEASE)
    candidates = [lease for lease in active if lease.reservation] or active
    if len(candidates) == 1:
        return str(candidates[0].id)
    kind = "reservations" if candidates[0].reservation else "leases"
    lines = [f"you hold {len(candidates)} {kind}; name one: vaccel shell LEASE_ID"]
    lines += [f"  {lease.id}  {_devices(lease.devices)}  {_left(lease.expires_at)}  {lease.holder.command[:40]}"
              for lease in candidates]
    raise cli.CliError(cli.shown("\n".join(lines)))


def _devices(devices: Any) -> str:
    return ",".join(d.label or f"gpu{d.index}" for d in devices)


def _left(expires_at: float) -> str:
    from vaccel_common.units import format_duration

    return f"{format_duration(max(0.0, expires_at - time.time()))} left" if expires_at else "no time limit"


def login_shell() -> str:
    """$SHELL, else the user's shell from the password database, else /bin/sh."""
    shell = os.environ.get("SHELL", "")
    if not shell:
        try:
            shell = pwd.getpwuid(os.getuid()).pw_shell
        except KeyError:
            shell = ""
    if not shell or shell.endswith("/nologin") or shell.endswith("/false"):
        shell = "/bin/sh"
    return shell


def prompt_marker(held: Any) -> str:
    return f"(vaccel {_devices(held.devices) or held.id}) "


def shell_env(held: Any, shell: str) -> dict[str, str]:
    """Our environment with only the lease's devices visible (what `vaccel run` gives its
    command) and the prompt marker in VACCEL_PROMPT; in PS1 too for shells other than bash
    (bash gets it from the rcfile, after ~/.bashrc has set its PS1)."""
    from vaccel.run.runner import child_env

    env = child_env(held, None)
    marker = prompt_marker(held)
    env["VACCEL_PROMPT"] = marker
    if os.path.basename(shell) != "bash":
        env["PS1"] = marker + os.environ.get("PS1", "$ ")
    return env


def shell_argv(shell: str, command: str | None, env: dict[str, str]) -> list[str]:
    """The shell's argv: `-c COMMAND` as given; interactive bash with the rcfile (a pipe,
    so nothing is left on disk); any other shell as it starts by itself."""
    name = os.path.basename(shell)
    if command is not None:
        return [name, "-c", command]
    if name != "bash":
        return [name, "-i"]
    read_fd, write_fd = os.pipe()
    _fill_pipe(write_fd, bash_rc(env, read_fd))
    os.set_inheritable(read_fd, True)
    return [name, "--rcfile", f"/dev/fd/{read_fd}", "-i"]


def bash_rc(env: dict[str, str], rc_fd: int) -> str:
    """The rcfile: the usual start-up files, then the lease's variables and the marker;
    last it closes the pipe it came through (bash has read it whole by then)."""
    from vaccel_common.backends import DEVICE_ENV_VARS

    lease_vars = {k: v for k, v in env.items() if k in DEVICE_ENV_VARS or k.startswith("VACCEL_")}
    lines = [
        "# vaccel shell: your usual start-up files first",
        "[ -r /etc/bash.bashrc ] && . /etc/bash.bashrc",
        "[ -r ~/.bashrc ] && . ~/.bashrc",
        "# then the lease again, whatever they set",
        *(f"unset {var}" for var in DEVICE_ENV_VARS if var not in lease_vars),
        *(f"export {k}={shlex.quote(v)}" for k, v in sorted(lease_vars.items())),
        f'PS1={shlex.quote(env["VACCEL_PROMPT"])}"${{PS1-\\$ }}"',
        f"exec {rc_fd}<&-",
    ]
    return "\n".join(lines) + "\n"


def _fill_pipe(write_fd: int, text: str) -> None:
    """Write all of `text` and close: it is far below a pipe's buffer, so this cannot block."""
    try:
        os.write(write_fd, text.encode())
    finally:
        os.close(write_fd)
