"""A time limit on the command line (issue 33, items 2 and 9): Slurm's spellings are read as
Slurm reads them, a bare number is refused with a hint rather than guessed, and a command
stopped by its lease's time limit exits 124 (timeout(1)'s status; Slurm's TIMEOUT)."""

from __future__ import annotations

import json
import sys

import pytest
from vaccel.cli.common import CliError, time_arg

from tests.conftest import Broker
from vaccel_common.units import parse_time_limit


@pytest.mark.parametrize(("text", "seconds"), [
    ("30:00", 1800), ("01:30:00", 5400), ("1-12", 129600), ("1-12:30", 131400), ("1-12:30:15", 131415),
    ("90m", 5400), ("2h", 7200), ("1d12h", 129600), ("45s", 45),
])
def test_slurm_forms_and_units_are_read_as_slurm_and_the_docs_say(text: str, seconds: int):
    assert parse_time_limit(text) == seconds
    assert time_arg(text) == seconds


@pytest.mark.parametrize(("text", "said"), [
    ("90", "--time 90: give a unit: 90m for minutes (what Slurm means by a bare number), 90s for seconds"),
    ("-5m", "--time -5m: a time limit must be longer than 0"),
    ("1:2:3:4", "--time: not a duration: '1:2:3:4' (try 90m, 2h, 1d12h, or as Slurm writes it"),
    ("400d", "--time 400d: longer than any lease may be (at most 366d"),
])
def test_a_bare_number_or_a_wrong_time_is_refused_with_what_to_write(text: str, said: str):
    with pytest.raises(CliError) as refused:
        time_arg(text)
    assert str(refused.value).startswith(said) and refused.value.code == 2


def test_run_takes_a_slurm_time_and_refuses_a_bare_number_before_asking(broker: Broker):
    inner = f"{sys.executable} -m vaccel.cli leases --json"
    r = broker.vaccel("run", "--time", "01:30:00", "--", "sh", "-c", inner)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["leases"][0]["time_limit_s"] == 5400
    r = broker.vaccel("run", "--time", "90", "--", "true")
    assert r.returncode == 2 and "give a unit: 90m for minutes" in r.stderr
    # argparse took "-5m" for an option ("expected one argument"): now the value is judged.
    r = broker.vaccel("run", "--time", "-5m", "--", "true")
    assert r.stderr == "vaccel: --time -5m: a time limit must be longer than 0\n"
    r = broker.vaccel("reserve", "--time", "1-00:00")
    assert r.returncode == 0, r.stderr
    assert "(23h59m from now)" in r.stdout or "(1d00h from now)" in r.stdout


def test_a_command_its_time_limit_stopped_exits_124(broker: Broker):
    r = broker.vaccel("run", "--time", "2s", "--", "sleep", "60")
    assert r.returncode == 124, r.stderr
    assert "reached its time limit" in r.stderr or "time limit of 2s" in r.stderr
    assert "(exit status 124: time limit)" in r.stderr
    # A command that ends by itself in time keeps its own status.
    assert broker.vaccel("run", "--time", "1m", "--", "sh", "-c", "exit 3").returncode == 3
