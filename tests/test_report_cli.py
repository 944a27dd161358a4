"""`vaccel report` against a real daemon: the JSON and CSV shapes after real leases, the
period options and their mistakes, and (with real Unix users) who sees whose rows."""

from __future__ import annotations

import csv
import io
import json
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_multiuser import as_user, root_broker, staged  # noqa: F401  (fixtures)

ROW_KEYS = {"key", "device_hours", "leases", "wait_p50_s", "wait_p90_s", "idle_device_hours"}


def report(broker, *args: str) -> dict:
    r = broker.vaccel("report", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_report_after_two_leases_as_json_csv_and_table(broker):
    for gpus in ("1", "2"):
        run = broker.vaccel("run", "--gpus", gpus, "--", "true")
        assert run.returncode == 0, run.stderr
    me = pwd.getpwuid(os.getuid()).pw_name

    doc = report(broker)
    assert {"since", "until", "rows", "total", "by", "rows_hidden"} <= set(doc)
    assert doc["until"] - doc["since"] == pytest.approx(7 * 86400)
    assert [row["key"] for row in doc["rows"]] == [me]
    assert all(ROW_KEYS <= set(row) for row in [*doc["rows"], doc["total"]])
    total = doc["total"]
    assert (total["leases"], total["end_reasons"], doc["rows_hidden"]) == (2, {"released": 2}, False)
    assert total["device_hours"] > 0 and total["wait_max_s"] >= total["wait_p90_s"] >= total["wait_p50_s"] >= 0

    by_device = report(broker, "--by", "device")
    status = json.loads(broker.vaccel("status", "--json").stdout)
    assert {row["key"] for row in by_device["rows"]} <= {d["uuid"] for d in status["devices"]}
    assert sum(row["leases"] for row in by_device["rows"]) == 3  # the second lease held two devices
    today = time.strftime("%Y-%m-%d")
    by_day = report(broker, "--by", "day", "--from", today, "--to", today)
    assert by_day["total"]["leases"] == 2 and all(len(row["key"]) == 10 for row in by_day["rows"])
    assert report(broker, "--since", "1d", "--by", "group")["total"]["leases"] == 2

    by_lease = report(broker, "--by", "lease")
    assert [row["lease"]["devices"] for row in by_lease["rows"]] == [1, 2]  # oldest first
    first = by_lease["rows"][0]["lease"]
    assert set(first) == {"user", "requested_at", "granted_at", "ended_at", "devices", "time_limit_s",
                          "reservation", "state"}
    assert (first["user"], first["state"], first["reservation"]) == (me, "released", False)
    assert first["requested_at"] <= first["granted_at"] <= first["ended_at"]
    assert first["time_limit_s"] == 86400  # the default applies
    r = broker.vaccel("report", "--by", "lease", "--csv")
    assert r.returncode == 0, r.stderr
    leases = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [line["key"] for line in leases] == [row["key"] for row in by_lease["rows"]]  # no total line
    assert (leases[1]["devices"], leases[1]["reservation"], leases[1]["state"]) == ("2", "0", "released")
    from bench.lab.convert import from_vaccel  # the lab benchmark replays this export

    assert [job.gpus for job in from_vaccel(r.stdout, default_time_s=86400)[0]] == [1, 2]
    table = broker.vaccel("report", "--by", "lease")
    assert table.returncode == 0 and "TIME LIMIT" in table.stdout and "1d00h" in table.stdout, table.stdout

    r = broker.vaccel("report", "--csv")
    assert r.returncode == 0, r.stderr
    lines = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [line["key"] for line in lines] == [me, "(total)"]
    assert (lines[-1]["leases"], lines[-1]["end_reasons"]) == ("2", "released=2")

    table = broker.vaccel("report")
    assert table.returncode == 0 and "DEVICE-HOURS" in table.stdout and "TOTAL" in table.stdout


@pytest.mark.parametrize(("args", "says"), [
    (("--since", "7d", "--from", "2025-01-01"), "either --since or --from/--to"),
    (("--from", "31/01/2025"), "is not a date"),
    (("--since", "soon"), "--since: not a duration"),
    (("--from", "2030-01-02", "--to", "2030-01-01"), "--from must come before --to"),
])
def test_report_mistakes_are_one_line_and_exit_2(args, says, tmp_path):
    env = {**os.environ, "VACCEL_SOCKET": str(tmp_path / "none.sock")}  # refused before connecting
    r = subprocess.run([sys.executable, "-m", "vaccel.cli", "report", *args], env=env, capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2
    assert says in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.multiuser
@pytest.mark.skipif(os.geteuid() != 0, reason="multi-user tests need root to create users")
def test_other_users_rows_only_for_admins(root_broker, staged: Path):  # noqa: F811
    for user in ("vaccel-alice", "vaccel-bob"):
        run = as_user(root_broker, staged, user, "run", "--", "true")
        assert run.returncode == 0, run.stderr

    def seen_by(user: str, *args: str) -> dict:
        r = as_user(root_broker, staged, user, "report", "--json", *args)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    bob = seen_by("vaccel-bob")
    assert ([row["key"] for row in bob["rows"]], bob["rows_hidden"], bob["total"]["leases"]) == (
        ["vaccel-bob"], True, 2)
    table = as_user(root_broker, staged, "vaccel-bob", "report")
    assert "vaccel-alice" not in table.stdout and "root and the admin group only" in table.stdout
    by_day = seen_by("vaccel-bob", "--by", "day")  # totals by day name nobody
    assert by_day["rows_hidden"] is False and sum(row["leases"] for row in by_day["rows"]) == 2
    carol = seen_by("vaccel-carol")  # in the admin group
    assert ({row["key"] for row in carol["rows"]}, carol["rows_hidden"]) == ({"vaccel-alice", "vaccel-bob"}, False)
