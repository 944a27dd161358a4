"""The [policy] section: what it accepts, and that a bad value is refused with the file,
its line and the key (a reload then keeps the running policy: tests/test_governance.py)."""

from __future__ import annotations

import grp
import os
from pathlib import Path

import pytest

from brokerd.config.loader import ConfigError, load_config

MY_GROUP = grp.getgrgid(os.getgid()).gr_name


def config_from(tmp_path: Path, text: str):
    path = tmp_path / "brokerd.toml"
    path.write_text(text)
    return load_config(path)


def test_defaults_apply_to_everyone_and_a_group_overrides_only_what_it_sets(tmp_path: Path):
    config = config_from(tmp_path, f"""
[policy]
fair_half_life = "12h"
aging = "2h"
[policy.default]
max_devices = 3
time_default = "2h"
[policy.group.{MY_GROUP}]
max_devices = 1
time_max = "8h"
""")
    policy = config.policy
    assert policy.fair_half_life_s == 12 * 3600 and policy.aging_s == 2 * 3600
    nobody = policy.for_user("nobody-here")
    assert (nobody.name, nobody.max_devices, nobody.time_default_s, nobody.time_max_s) == (
        "default", 3, 7200, 7 * 86400)
    me = policy.for_user(os.environ.get("USER", "root"))
    assert (me.name, me.max_devices, me.time_default_s, me.time_max_s) == (f"group {MY_GROUP}", 1, 7200, 8 * 3600)


def test_the_first_configured_group_a_user_is_in_wins(tmp_path: Path):
    other = next((g.gr_name for g in grp.getgrall() if g.gr_gid != os.getgid()), None)
    if other is None:
        pytest.skip("needs a second group on this host")
    config = config_from(tmp_path, f"""
[policy.group.{MY_GROUP}]
max_devices = 1
[policy.group.{other}]
max_devices = 5
""")
    assert config.policy.for_user("root").max_devices == 1


@pytest.mark.parametrize(("text", "line", "message"), [
    ("[policy.default]\nmax_devices = -1\n", 2, "policy.default.max_devices: must not be negative"),
    ("[policy.default]\nmax_devices = 2.5\n", 2, "policy.default.max_devices: must be a whole number"),
    ("[policy.default]\nmax_devices = 100000\n", 2, "policy.default.max_devices: 100000 is absurd"),
    ("\n[policy.default]\nmax_gpus = 2\n", 3,
     "policy.default.max_gpus: unknown key 'max_gpus'; known keys: max_devices"),
    # y is a unit since `vaccel report --since 1y` (issue 46): 100 years is absurd, 100q no duration.
    ("[policy.default]\ntime_max = \"100q\"\n", 2, "policy.default.time_max: not a duration: '100q'"),
    ("[policy.default]\ntime_max = \"100y\"\n", 2, "policy.default.time_max: '100y' is absurd"),
    ("[policy.default]\ntime_max = \"9999d\"\n", 2, "policy.default.time_max: '9999d' is absurd"),
    ("[policy.default]\ntime_default = \"8d\"\n", 2, "time_default (8d00h) is longer than time_max (7d00h)"),
    ("[policy]\nfair_halflife = \"1h\"\n", 2, "policy.fair_halflife: unknown key 'fair_halflife'"),
    ("# students\n[policy.group.no-such-group-here]\nmax_devices = 1\n", 2,
     "[policy.group.no-such-group-here]: there is no Unix group 'no-such-group-here' on this host"),
    ("[policy.default]\nwindow = \"10m\"\n", 2, "policy.default.window: must be at least 1h"),
    ("[policy.default]\nmin_share = \"lots\"\n", 2, "policy.default.min_share: not a size: 'lots'"),
    ("[policy.default]\nmax_leases = -1\n", 2, "policy.default.max_leases: must not be negative"),
])
def test_a_bad_value_is_refused_with_file_line_and_key(tmp_path: Path, text: str, line: int, message: str):
    with pytest.raises(ConfigError) as refused:
        config_from(tmp_path, text)
    assert str(refused.value).startswith(f"{tmp_path / 'brokerd.toml'}:{line}: "), str(refused.value)
    assert message in str(refused.value)


def test_leases_and_shares_are_capped_per_user_by_default(tmp_path: Path):
    """One user's thousands of 1 MiB shares (issue 43): max_leases and min_share, set or not."""
    default = config_from(tmp_path, "").policy.for_user("nobody-here")
    assert (default.max_leases, default.min_share_mib) == (64, 1024)
    mine = config_from(tmp_path, '[policy.default]\nmax_leases = 8\nmin_share = "4GiB"\n').policy.for_user("x")
    assert (mine.max_leases, mine.min_share_mib) == (8, 4096)
    assert mine.user_limits().max_leases == 8 and mine.user_limits().min_share_mib == 4096
