"""`vaccel kernel install`: registered with the CLI here, with nothing of Jupyter imported
until the command runs (every `vaccel` start builds the parser)."""

from __future__ import annotations

import argparse
import sys

EXAMPLES = """\
examples:
  vaccel kernel install --user                  "Python 3 (vaccel, 1 GPU)" for you
  vaccel kernel install --gpus 2 --sys-prefix   for everyone using this Python environment
  sudo vaccel kernel install --on-busy fail     system-wide (JupyterHub): fail at once when busy
  jupyter kernelspec remove vaccel-1gpu         uninstall
"""


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("kernel", parents=[common], help="Jupyter kernels that hold devices while they run",
                       description="A notebook kernel that leases devices when it starts and gives them back "
                                   "when it shuts down, is restarted, culled or killed.")
    kernel_sub = p.add_subparsers(dest="kernel_command", metavar="SUBCOMMAND", required=True)
    i = kernel_sub.add_parser(
        "install", parents=[common], help="install the vaccel kernelspec",
        description="Install a Jupyter kernelspec whose kernels lease GPUS devices for as long as they live. "
                    "Without --user or --sys-prefix it goes to the system's Jupyter folder (root).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("--gpus", type=int, default=1, help="devices each kernel leases (default 1)")
    i.add_argument("--name", help="the kernelspec's name (default vaccel-1gpu, vaccel-2gpu, ...)")
    i.add_argument("--display-name", help='what the launcher shows (default "Python 3 (vaccel, 1 GPU)")')
    where = i.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for you only (~/.local/share/jupyter)")
    where.add_argument("--sys-prefix", action="store_true", help=f"for this Python environment ({sys.prefix})")
    i.add_argument("--on-busy", choices=("wait", "fail"), default="wait",
                   help="no device free at kernel start: wait in the queue (default), or fail the start "
                        "at once with the queue's message")
    i.add_argument("--max-wait", metavar="DURATION", help="wait at most this long (e.g. 45s), then fail")
    i.add_argument("--without-provisioner", action="store_true",
                   help="for a Jupyter server whose Python lacks vaccel: the kernel then reports its "
                        "queue place only in the server's log, a refused start shows as a dead kernel, and "
                        "Jupyter's automatic restart after a revoke or time limit leases again")
    i.set_defaults(func=cmd_kernel_install)


def cmd_kernel_install(args: argparse.Namespace) -> int:
    from vaccel.cli import common as cli
    from vaccel.kernel import install
    from vaccel_common.units import parse_duration

    cli.gpus_arg(args.gpus)
    if args.max_wait is not None:
        try:
            parse_duration(args.max_wait)
        except ValueError as exc:
            raise cli.CliError(f"--max-wait: {exc}", cli.EXIT_USAGE) from None
    missing = install.missing_packages()
    if missing:
        raise cli.CliError(f"the vaccel kernel needs {' and '.join(missing)} in this Python ({sys.executable}): "
                           "pip install 'vaccel[jupyter]'", cli.EXIT_USAGE)
    name = args.name or install.default_name(args.gpus)
    problem = install.name_problem(name)
    if problem:
        raise cli.CliError(f"--name {name!r}: {problem}", cli.EXIT_USAGE)
    _check_host_has(args)
    display = args.display_name or install.display_name(args.gpus, args.on_busy, args.max_wait)
    spec = install.kernel_spec(gpus=args.gpus, on_busy=args.on_busy, max_wait=args.max_wait,
                               socket=getattr(args, "socket", None), display=display,
                               provisioner=not args.without_provisioner)
    try:
        folder = install.install(name, spec, user=args.user, sys_prefix=args.sys_prefix)
    except PermissionError as exc:
        raise cli.CliError(f"cannot write {exc.filename or 'the system kernel folder'}: installing for every "
                           "user needs root; --user installs for you, --sys-prefix for this environment") from None
    except ValueError as exc:  # a kernel name Jupyter refuses
        raise cli.CliError(f"--name {name!r}: {exc}", cli.EXIT_USAGE) from None
    print(f'installed "{display}" as {name} in {folder}')
    return 0


def _check_host_has(args: argparse.Namespace) -> None:
    """A kernel asking for more devices than this host has would never start: refuse it now.
    Without a broker to ask (installing before it runs), say so and go on."""
    from vaccel.cli import common as cli
    from vaccel_common.v1 import broker_pb2 as pb

    try:
        devices = len(cli.rpc(cli.connection(args), "Status", pb.StatusRequest()).devices)
    except cli.CliError as exc:
        print(f"vaccel: could not ask the broker how many devices this host has ({exc}); installing anyway",
              file=sys.stderr)
        return
    if args.gpus > devices:
        raise cli.CliError(f"--gpus {args.gpus}: this host has {devices} device{'s' if devices != 1 else ''} "
                           "(`vaccel status`); a kernel asking for more would never start", cli.EXIT_USAGE)
