"""An admin's first week (issue 44, item 3): what the daemon's files and words say, each
the way an admin meets it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from brokerd.config import loader
from brokerd.config.loader import ConfigError, load_config
from brokerd.config.policy import _LIMIT_KEYS, _TOP_KEYS
from brokerd.contract import Requirement
from brokerd.devices.probes.simulated import InventoryError, parse_inventory
from brokerd.leasing.model import IDLE, OVER_BUDGET, REVOKED
from tests.test_leases import ALICE, manager

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "brokerd.toml"


def _documented(text: str) -> set[str]:
    """table.key of every key the file sets or shows commented out."""
    table, keys = "", set()
    for line in text.splitlines():
        if header := re.match(r"\s*#?\s*\[([a-z_.]+)\]", line):
            table = header.group(1)
        elif key := re.match(r"\s*#?\s*([a-z_]+)\s*=", line):
            keys.add(f"{table}.{key.group(1)}")
    return keys


def test_the_example_config_documents_every_key_the_daemon_knows():
    documented = _documented(EXAMPLE.read_text())
    # lend_idle is a [policy] key the parser reads apart (a bool, not a duration).
    known = set(loader._KEYS) | {f"policy.{k}" for k in (*_TOP_KEYS, "lend_idle")} | \
        {f"policy.default.{k}" for k in _LIMIT_KEYS}
    assert not known - documented, f"examples/brokerd.toml lacks {sorted(known - documented)}"
    assert not documented - known - {"policy.group.students." + k for k in _LIMIT_KEYS}, \
        f"examples/brokerd.toml shows keys the daemon refuses: {sorted(documented - known)}"
    load_config(EXAMPLE)  # and loads as written


@pytest.mark.parametrize(("key", "value", "said"), [
    ("leases.token_ttl", '"5s"', "leases.token_ttl must be at least 60s"),
    ("server.durability", '"disk"', "server.durability must be 'crash'"),
    ("accounting.max_rows", "10", "accounting.max_rows must be at least 1000"),
])
def test_a_value_the_daemon_refuses_is_named_with_its_line(tmp_path: Path, key: str, value: str, said: str):
    table, leaf = key.split(".")
    path = tmp_path / "brokerd.toml"
    path.write_text(f'[server]\nlog_level = "info"\n\n[{table}]\n# a comment\n{leaf} = {value}\n'
                    if table != "server" else f'[server]\nlog_level = "info"\n# a comment\n\n\n{leaf} = {value}\n')
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value).startswith(f"{path}:6: {said}"), refused.value


INVENTORY = """devices:
  - vendor: nvidia
    name: NVIDIA A100-SXM4-80GB
    uuid: GPU-1
    memory_mib: 81920
    {extra}
"""


@pytest.mark.parametrize(("extra", "said"), [
    ("usage_fil: /tmp/usage.json", "inv.yaml:6: devices[0]: unknown key 'usage_fil'; did you mean 'usage_file'?"),
    ("mig:\n      - {uuid: MIG-1, profile: 1g.10gb, memory_mib: 9728, usage_fil: x}",
     "inv.yaml:7: devices[0].mig[0]: unknown key 'usage_fil'; did you mean 'usage_file'?"),
])
def test_a_misspelt_inventory_key_is_refused_with_its_line_and_a_did_you_mean(extra: str, said: str):
    with pytest.raises(InventoryError) as refused:
        parse_inventory(INVENTORY.format(extra=extra), "inv.yaml")
    assert str(refused.value) == said


def test_a_misspelt_top_level_or_process_key_is_refused_too():
    with pytest.raises(InventoryError) as refused:
        parse_inventory(INVENTORY.format(extra="") + "process:\n  - {pid: 1}\n", "inv.yaml")
    assert str(refused.value) == "inv.yaml:7: unknown key 'process'; did you mean 'processes'?"
    text = INVENTORY.format(extra="") + "processes:\n  - {device_uuid: GPU-1, pid: 7, used_memory: 10}\n"
    with pytest.raises(InventoryError) as refused:
        parse_inventory(text, "inv.yaml")
    assert str(refused.value) == ("inv.yaml:8: processes[0]: unknown key 'used_memory'; "
                                  "did you mean 'used_memory_mib'?")


@pytest.mark.parametrize(("state", "notice", "reason"), [
    (REVOKED, "revoked by root: maintenance (ends at 17:33:54)", "revoked by root: maintenance"),
    (IDLE, "idle for 12m while others wait: reclaimed at 17:36:11 unless it computes",
     "idle for 12m while others wait: reclaimed"),
    (OVER_BUDGET, "uses 30 GiB of device memory, over its share of 20 GiB: stopped at 17:36:11 (10s from now) "
                  "unless it is back within its share",
     "uses 30 GiB of device memory, over its share of 20 GiB: stopped"),
])
def test_an_ended_lease_says_what_happened_not_what_would_unless(state: str, notice: str, reason: str):
    m, clock = manager(1)
    lease = m.submit(ALICE, Requirement(1), wait=False)
    m.end_early(lease.id, clock.now + 30, state, notice)
    assert m.leases[lease.id].notice == notice  # the warning, while it runs
    clock.now += 31
    (ended,) = m.expire()
    assert (ended.state, ended.end_reason) == (state, reason)


def test_a_request_over_max_waiting_exits_75_as_the_readme_says(start_broker):
    import subprocess

    from tests.test_broker_integration import leased, status, wait_for

    broker = start_broker(config='[leases]\nheartbeat_ttl = "3s"\n[policy.default]\nmax_waiting = 1\n')
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--gpus", "4", "--", "sleep", "3600"],
                              env=broker.env, stderr=subprocess.PIPE)
    waiter = None
    try:
        wait_for(lambda: len(leased(broker)) == 4)
        waiter = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--", "true"], env=broker.env,
                                  stderr=subprocess.PIPE)
        wait_for(lambda: status(broker)["queue"])
        r = broker.vaccel("run", "--", "true")
        assert r.returncode == 75 and "limit max_waiting=1" in r.stderr, r.stderr
    finally:
        for p in (holder, waiter):
            if p is not None:
                p.kill()
                p.wait()
    readme = (ROOT / "README.md").read_text()
    assert "75 busy with `--no-wait`, `--wait` ran out, or your waiting requests are at your `max_waiting`" in readme


def test_report_shows_idle_device_hours_as_not_measured_on_simulated_devices(broker):
    """The simulated inventory measures no utilisation: its idle device-hours are unknown,
    which the table says with "-", not 0.00 ("nothing was idle")."""
    import json

    run = broker.vaccel("run", "--", "true")
    assert run.returncode == 0, run.stderr
    r = broker.vaccel("report")
    assert r.returncode == 0, r.stderr
    header, *rows = r.stdout.splitlines()[1:]
    column = header.index("IDLE DEV-H")
    assert rows and all(row[column:].split()[0] == "-" for row in rows), r.stdout
    doc = json.loads(broker.vaccel("report", "--json").stdout)
    assert doc["total"]["idle_measured"] is False and doc["total"]["idle_device_hours"] == 0
