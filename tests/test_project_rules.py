"""Project rules that CI enforces: generated gRPC code is fresh, the code is ruff clean,
vendor names stay in probes and accelerator backends, and the daemon never imports torch."""

from __future__ import annotations

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


VENDOR_WORDS = re.compile(r"cuda|\bhip\b|nvml|amdsmi|\bxpu\b", re.IGNORECASE)
ALLOWED = ("brokerd/probes/", "client/backends.py", "client/accelerator/", "client/v1/")


def test_vendor_names_only_in_probes_and_backends():
    offenders = []
    for path in [*ROOT.joinpath("brokerd").rglob("*.py"), *ROOT.joinpath("client").rglob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if VENDOR_WORDS.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []


def test_the_daemon_never_imports_torch():
    code = ("import sys, brokerd.main, brokerd.server, brokerd.service, brokerd.servicer, brokerd.probes;"
            "from brokerd.probes import default_probes; default_probes();"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
