"""Project rules that CI enforces: generated gRPC code is fresh, the code is ruff clean,
vendor names stay in probes and accelerator backends, and the daemon never imports torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_grpc_code_is_fresh():
    r = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_clean():
    pytest.importorskip("ruff")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# Vendor runtimes and libraries: no file outside the allowed ones names them.
VENDOR_WORDS = re.compile(r"cuda|\bhip\b|nvml|amdsmi|\bxpu\b", re.IGNORECASE)
# Vendor facts (vendor names, runtimes and collectives, architecture families, marketing
# words): the daemon, the shared layer and the client keep them in the probes, the two
# tables and the accelerator backends.
# Vendor names as plain data values (`vendor: nvidia` in an inventory) are probe input.
VENDOR_FACTS = re.compile(
    r"nvidia|\bamd\b|\bintel\b|\brocm|oneapi|\b[nrx]ccl\b"  # vendors, runtimes, collectives
    r"|\bsm_|\bcompute_\d|gfx|\bxe\d?_"  # architecture families
    r"|geforce|radeon|instinct|tesla|quadro|\barc\b",  # marketing words
    re.IGNORECASE)
ALLOWED = ("brokerd/devices/probes/", "brokerd/devices/vendors.py", "vaccel_common/backends.py",
           "vaccel_common/v1/", "client/vaccel/accelerator/")


def _offenders(roots: tuple[str, ...], words: re.Pattern[str]) -> list[str]:
    offenders = []
    for path in (p for root in roots for p in ROOT.joinpath(root).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if words.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    return offenders


def test_vendor_names_only_in_probes_and_backends():
    assert _offenders(("brokerd", "vaccel_common", "client"), VENDOR_WORDS) == []
    assert _offenders(("brokerd", "vaccel_common", "client"), VENDOR_FACTS) == []


def test_the_daemon_never_imports_torch():
    code = ("import sys, brokerd.daemon.main, brokerd.daemon.server, brokerd.core.service, brokerd.edge.servicer,"
            " brokerd.devices.probes;"
            "from brokerd.devices.probes import default_probes; default_probes();"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_the_daemon_never_imports_the_client_and_leaves_its_environment_alone():
    """The daemon and the client share vaccel_common only: importing the whole daemon must
    neither import the client package `vaccel` nor change the daemon's own environment
    (the client turns gRPC's fork handlers off; the daemon must not inherit that)."""
    code = ("import os, sys; before = dict(os.environ);"
            "import brokerd.daemon.main, brokerd.daemon.server, brokerd.core.service, brokerd.edge.servicer,"
            " brokerd.contract, brokerd.devices.probes;"
            "from brokerd.devices.probes import default_probes; default_probes();"
            "client = sorted(m for m in sys.modules if m == 'vaccel' or m.startswith('vaccel.'));"
            "print(client, dict(os.environ) == before)")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] True"


def test_the_shared_layer_imports_nothing_of_either_side():
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in ROOT.joinpath("vaccel_common").rglob("*.py")
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if re.match(r"\s*(from|import)\s+(vaccel|brokerd)\b(?!_common)", line)]
    assert offenders == []
