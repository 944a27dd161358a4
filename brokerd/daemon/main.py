"""`vaccel-brokerd`: the command line of the daemon."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from brokerd import __version__
from brokerd.config.loader import DEFAULT_CONFIG_PATH, Config, ConfigError, load_config

DESCRIPTION = """\
The vaccel broker: owns this host's GPUs and hands out exclusive, durable leases.

  vaccel-brokerd                          serve (root: /run/vaccel/brokerd.sock)
  vaccel-brokerd --inventory lab.yaml     serve simulated devices (demos, tests, CI)
  vaccel-brokerd --probe [--json]         show what the device probes find, then exit
  vaccel-brokerd install-units            install the systemd unit and config example
                                          (for the lab's install: sudo make install)
  vaccel-brokerd write-unit-dropin        grant the unit what the configured features need
                                          (a drop-in; reload and install run it)

Users talk to it with `vaccel status`, `vaccel run`, or `with vaccel.lease():`.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vaccel-brokerd", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", nargs="?", choices=["serve", "install-units", "write-unit-dropin"], default="serve",
                        help="what to do (default: serve)")
    parser.add_argument("--config", type=Path, default=None,
                        help=f"TOML configuration file (default: {DEFAULT_CONFIG_PATH} if it exists)")
    parser.add_argument("--socket", type=Path, default=None,
                        help="gRPC Unix socket (default: /run/vaccel/brokerd.sock as root, else "
                             "$XDG_RUNTIME_DIR/vaccel/brokerd.sock)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the lease database lives (default: /var/lib/vaccel as root)")
    parser.add_argument("--inventory", type=Path, default=None,
                        help="serve the simulated devices of this YAML file instead of probing")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    parser.add_argument("--probe", action="store_true", help="print what the probes find and exit 0")
    parser.add_argument("--json", action="store_true", help="with --probe: machine-readable output")
    parser.add_argument("--dest", type=Path, default=None,
                        help="with install-units and write-unit-dropin: where the unit goes "
                             "(default /etc/systemd/system)")
    parser.add_argument("--destdir", type=Path, default=None,
                        help="with install-units: stage every file under this folder (DESTDIR, packaging)")
    parser.add_argument("--from-checkout", action="store_true",
                        help="with install-units: install even though this runs from a source checkout "
                             "(a development install; the lab's is `sudo make install`)")
    parser.add_argument("--version", action="version", version=f"vaccel-brokerd {__version__}")
    return parser


def _probe(config: Config, as_json: bool) -> int:
    from brokerd.daemon.server import inventory_source
    from brokerd.devices.probe_report import probe_report, render_probe_text
    from brokerd.devices.probes.simulated import InventoryError

    try:
        snapshot = inventory_source(config)()
    except InventoryError as exc:
        print(f"vaccel-brokerd: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(probe_report(snapshot), indent=2) if as_json else render_probe_text(snapshot))
    return 0


def _write_dropin(args: argparse.Namespace) -> int:
    from brokerd.daemon.unit_needs import DROPIN, UNIT, write_dropin

    path = args.dest / f"{UNIT}.d" / DROPIN.name if args.dest else DROPIN
    try:
        config = load_config(args.config or DEFAULT_CONFIG_PATH, {})
        changed = write_dropin(config, path)
    except ConfigError as exc:
        print(f"vaccel-brokerd: {exc}; the drop-in {path} is left as it was", file=sys.stderr)
        return 2
    except PermissionError as exc:
        print(f"vaccel-brokerd: cannot write {exc.filename}: permission denied (run it as root)", file=sys.stderr)
        return 1
    if changed:
        print(f"wrote {path}; it applies from: systemctl daemon-reload && systemctl restart vaccel-brokerd")
    else:
        print(f"{path} already grants what {config.source} needs")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "install-units":
        from brokerd.daemon.install_units import checkout_refusal, find_executable, install_units, running_checkout

        checkout = running_checkout()
        if checkout is not None and not args.from_checkout:
            print(f"vaccel-brokerd: {checkout_refusal(checkout)}", file=sys.stderr)
            return 2
        kwargs: dict[str, Any] = {"dest": args.dest} if args.dest else {}
        if args.destdir:  # staging (make install DESTDIR=, a package): every file under it, sysusers not run
            root = args.destdir.resolve()
            kwargs = {"dest": root / "etc/systemd/system", "config_dir": root / "etc/vaccel",
                      "sysusers_dir": root / "etc/sysusers.d", "root": root, **kwargs}
            exe = Path(find_executable())  # the staged one: the unit names where it will be
            kwargs["exec_path"] = f"/{exe.relative_to(root)}" if exe.is_relative_to(root) else str(exe)
        try:
            install_units(**kwargs)
        except PermissionError as exc:
            print(f"vaccel-brokerd: cannot write {exc.filename}: permission denied (run it as root)",
                  file=sys.stderr)
            return 1
        return 0
    if args.command == "write-unit-dropin":
        return _write_dropin(args)
    overrides = {"socket": args.socket, "state_dir": args.state_dir, "inventory": args.inventory,
                 "log_level": args.log_level}
    if args.config is not None and not args.config.exists():
        print(f"vaccel-brokerd: {args.config}: no such configuration file", file=sys.stderr)
        return 2
    config_path = args.config or DEFAULT_CONFIG_PATH
    try:
        config = load_config(config_path, overrides)
    except ConfigError as exc:
        print(f"vaccel-brokerd: {exc}", file=sys.stderr)
        return 2
    if args.probe:
        try:
            return _probe(config, args.json)
        except BrokenPipeError:  # `--probe | head`: the reader left, which is fine
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0

    from brokerd.base.journal import setup_logging
    from brokerd.daemon.server import Daemon, StartupError

    setup_logging(config.log_level)
    try:
        return asyncio.run(Daemon(config, config_path, overrides).run())
    except StartupError as exc:
        print(f"vaccel-brokerd: {exc}", file=sys.stderr)
        return 1
    except PermissionError as exc:
        print(f"vaccel-brokerd: cannot use {exc.filename}: permission denied (run as root for the "
              "system paths, or pass --socket and --state-dir you own)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
