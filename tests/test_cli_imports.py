"""`vaccel run` and `vaccel status` import only what their path needs: every module costs
each invocation start-up time (issue 16). Checked by module name, never by a timing."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

from tests.conftest import Broker

# Heavy and not needed without a contract or --json: torch (facts), yaml (contract files),
# protobuf's JSON mapping, and lease() machinery. Nor grpc (85-110 ms: these calls go over
# the identity socket, vaccel_common/side_call.py) or dataclasses (11 ms: it imports inspect).
NOT_ON_THE_PATH = ("torch", "yaml", "google.protobuf.json_format", "vaccel.leasing", "vaccel.contract.facts", "grpc",
                   "dataclasses")
# Nor, without --json, the rest of protobuf's Python layer (~25 ms: the classes come from
# upb, vaccel_common/proto_loader.py), pathlib (~9 ms with urllib.parse and ipaddress) or
# shutil (~3.5 ms: argparse's formatter asks it for the width, vaccel/cli/parser.py).
NOR_WITHOUT_JSON = ("google.protobuf.text_format", "google.protobuf.internal.python_message",
                    "google.protobuf.descriptor_pool", "pathlib", "shutil")


def _loaded_after(broker: Broker, argv: list[str], cwd: Path) -> tuple[int, list[str]]:
    """Run the CLI in-process in a fresh interpreter (in `cwd`: no contract files there)."""
    code = textwrap.dedent(f"""
        import json, sys
        from vaccel.cli import full as cli
        rc = cli.main({argv!r})
        print(json.dumps([rc, [m for m in {NOT_ON_THE_PATH + NOR_WITHOUT_JSON!r} if m in sys.modules]]))
    """)
    done = subprocess.run([broker.python, "-c", code], env=broker.env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    rc, loaded = json.loads(done.stdout.splitlines()[-1])
    return rc, loaded


def test_vaccel_run_without_a_contract_imports_nothing_heavy(broker: Broker, tmp_path: Path):
    rc, loaded = _loaded_after(broker, ["run", "-q", "--", "true"], tmp_path)
    assert rc == 0
    assert loaded == []


def test_vaccel_status_imports_nothing_heavy_and_json_still_works(broker: Broker, tmp_path: Path):
    rc, loaded = _loaded_after(broker, ["status"], tmp_path)
    assert rc == 0 and loaded == []
    rc, loaded = _loaded_after(broker, ["status", "--json"], tmp_path)
    assert rc == 0 and [m for m in loaded if m in NOT_ON_THE_PATH] == ["google.protobuf.json_format"]
