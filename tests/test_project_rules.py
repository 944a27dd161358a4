"""Project rules that CI enforces: generated gRPC code is fresh, the code is ruff clean,
vendor names stay in probes and accelerator backends, and the daemon never imports torch."""

from __future__ import annotations

import ast
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


# The daemon's layers, lowest first: a module may import its own layer and those below it,
# never one above (brokerd/__init__.py says what each owns).
LAYERS = ("base", "devices", "contract", "leasing", "config", "state", "core", "edge", "addons", "daemon")


def test_no_import_circles_anywhere():
    from tests.import_graph import cycles, edges

    assert cycles(edges()) == []


def test_the_daemon_imports_only_down_its_layers():
    from tests.import_graph import edges

    upward = []
    for module, targets in edges().items():
        parts = module.split(".")
        if parts[0] != "brokerd" or len(parts) < 3:
            continue
        layer = LAYERS.index(parts[1])
        for target in targets:
            tparts = target.split(".")
            if tparts[0] == "brokerd" and len(tparts) > 1 and LAYERS.index(tparts[1]) > layer:
                upward.append(f"{module} -> {target}")
    assert upward == []
    top = sorted(p.name for p in (ROOT / "brokerd").iterdir() if p.name != "__pycache__")
    assert top == sorted(["__init__.py", "__main__.py", *LAYERS])


# The client's layers, lowest first (each package's __init__ says what it owns): a module may
# import its own layer and those below it. The library's modules (vaccel.leasing, vaccel.current
# and the package root) sit between the machinery and the command line; vaccel.entry and
# `python -m vaccel` on top.
CLIENT_LAYERS = (("accelerator",), ("contract",), ("session",), ("slurm",), ("containers",), ("run",),
                 ("", "leasing", "current"), ("cli",), ("kernel",), ("entry", "__main__"))


def _client_layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(CLIENT_LAYERS) if part in names)


def test_the_client_imports_only_down_its_layers():
    from tests.import_graph import edges

    upward = [f"{module} -> {target}" for module, targets in edges().items() if module.split(".")[0] == "vaccel"
              for target in targets
              if target.split(".")[0] == "vaccel" and _client_layer(target) > _client_layer(module)]
    assert upward == []
    top = sorted(p.name for p in (ROOT / "client" / "vaccel").iterdir() if p.name != "__pycache__")
    assert len(top) <= 16, top
    packages = [p for p in (ROOT / "client" / "vaccel").rglob("__init__.py") if "__pycache__" not in p.parts]
    # Every package says what it owns and what it may import.
    assert [str(p) for p in packages
            if "may import" not in (ast.get_docstring(ast.parse(p.read_text())) or "").lower()] == []


def test_no_module_over_400_lines():
    from tests.import_graph import GENERATED, modules

    long = [f"{path.relative_to(ROOT)}: {n}" for path in modules().values()
            if GENERATED not in path.as_posix() and (n := len(path.read_text().splitlines())) > 400]
    assert long == []
