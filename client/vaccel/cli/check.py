"""`vaccel check [runtime-spec.yaml] [--python PATH]`: can this host, and the Python the
job will run, meet a contract? Its Python side (torch build, arch list, dependencies) is
checked against the interpreter --python names, else the first `python3` on PATH, the
one `python3 train.py` would run (vaccel/contract/job_python.py); never against the `vaccel`
command's own interpreter unless it is that one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from vaccel.cli.common import EXIT_USAGE, CliError, connection, gpus_arg, rpc, size_arg, to_dict
from vaccel_common.v1 import broker_pb2 as pb


def cmd_check(args: argparse.Namespace) -> int:
    from vaccel.contract.files import ContractFileError, load_contract_files
    from vaccel.contract.report import check_exit_code, render_check

    gpus = gpus_arg(args.gpus)  # refused as `vaccel run` refuses it
    try:
        files = load_contract_files(args.spec, args.config, os.getcwd())
    except ContractFileError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if not files.empty:
        print(f"vaccel: {files.said()}", file=sys.stderr)
    request = pb.CheckRequest(
        runtime_spec_yaml=files.spec_text, runtime_spec_name=files.spec_name,
        accelerator_config_yaml=files.config_text, accelerator_config_name=files.config_name,
        gpus=gpus, min_memory_mib=size_arg(args.min_memory),
    )
    request.client.CopyFrom(_facts(args.python, files.packages))
    reply = rpc(connection(args), "Check", request)
    print(json.dumps(to_dict(reply), indent=2) if args.json else render_check(reply))
    return check_exit_code(reply)


def _facts(python: str | None, packages: tuple[str, ...]) -> pb.ClientFacts:
    from vaccel.contract.job_python import ProbeFailed, python_at

    path = python if python is None or os.sep in python else shutil.which(python)
    if python is not None and path is None:
        raise CliError(f"--python {python}: not found on PATH", EXIT_USAGE)
    path = path or shutil.which("python3")
    if path is None:
        raise CliError("no python3 on PATH to check the contract's Python side against: name one "
                       "with --python PATH", EXIT_USAGE)
    try:
        found = python_at(path, packages)
    except ProbeFailed as exc:
        raise CliError(f"--python {path}: {exc}", EXIT_USAGE) from None
    print(f"vaccel: {found.said()}", file=sys.stderr)
    return found.facts
