"""What the CLI says when something is off (issue 33, items 7 and 9): one line that names the
option at fault, never protobuf's or argparse's words; lists that show what Slurm's would
(time left, waiting requests, who drained a device and when); idempotent second tries.
Against a real daemon; the revoke messages with real Unix users (root only)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from brokerd.config.loader import Config, ConfigError, load_config
from brokerd.daemon.server import inventory_source
from tests.conftest import Broker
from tests.test_broker_integration import drained_by_me, leased, status, wait_for
from tests.test_multiuser import alice_holds_a_gpu, as_user, root_broker, staged  # noqa: F401


def one_line(r: subprocess.CompletedProcess[str], code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    return r.stderr.rstrip("\n")


def test_usage_mistakes_are_one_line_naming_the_option(broker: Broker):
    assert one_line(broker.vaccel("run", "--gpus"), 2) == (
        "vaccel run: argument --gpus: expected one argument (see `vaccel run --help`)")
    assert one_line(broker.vaccel("status", "--jsn"), 2) == (
        "vaccel status: unrecognized argument: --jsn; did you mean --json? (see `vaccel status --help`)")
    assert one_line(broker.vaccel("run", "--gpus", "1000000000000", "--", "true"), 2) == (
        "vaccel: --gpus 1000000000000: more devices than any host has (`vaccel status` lists this one's)")
    said = one_line(broker.vaccel("run", "--wait", "100000000d", "--", "true"), 2)
    assert said.startswith("vaccel: --wait 100000000d: longer than a year") and "." not in said.split(":")[1]
    assert one_line(broker.vaccel("report", "--since", "100000d"), 2).startswith(
        "vaccel: --since 100000d: that reaches back before 1970")
    assert one_line(broker.vaccel("run", "--min-memory", "1000000000000GiB", "--", "true"), 2) == (
        "vaccel: --min-memory 1000000000000GiB: more memory than any device has")
    assert one_line(broker.vaccel("check", "--gpus", "0"), 2) == "vaccel: --gpus must be at least 1, got 0"
    assert one_line(broker.vaccel("run", "--gpus", "0", "--", "true"), 2) == "vaccel: --gpus must be at least 1, got 0"


def test_a_kernel_install_is_refused_a_name_that_is_no_folder_and_more_gpus_than_the_host_has(
        broker: Broker, tmp_path: Path):
    pytest.importorskip("ipykernel")
    env = {**broker.env, "JUPYTER_DATA_DIR": str(tmp_path / "data"), "TMPDIR": str(tmp_path)}
    r = broker.vaccel("kernel", "install", "--user", "--name", "../../evil", env=env)
    assert one_line(r, 2) == ("vaccel: --name '../../evil': '/' cannot be in a kernel name (ASCII letters, digits, "
                              "'-', '.', '_')")
    r = broker.vaccel("kernel", "install", "--user", "--gpus", "9", env=env)
    assert one_line(r, 2) == ("vaccel: --gpus 9: this host has 4 devices (`vaccel status`); a kernel asking for more "
                              "would never start")
    assert not (tmp_path / "data").exists() and not (tmp_path / "evil").exists()  # nothing written anywhere


def test_devices_are_named_in_any_case_and_each_once(broker: Broker):
    r = broker.vaccel("run", "--device", "GPU1", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
    gpu1 = next(d for d in status(broker)["devices"] if d["index"] == 1)
    assert r.returncode == 0 and r.stdout.strip() == gpu1["uuid"], r.stderr
    assert one_line(broker.vaccel("run", "--device", "gpu1", "--device", "gpu1", "--", "true"), 2) == (
        "vaccel: --device gpu1 is named twice: name each device once")
    said = one_line(broker.vaccel("run", "--device", "gpu1", "--device", gpu1["uuid"].lower(), "--", "true"), 1)
    assert said == f"vaccel: gpu1 and {gpu1['uuid'].lower()} name the same device: name each device once"


def test_version_says_which_install_runs():
    r = subprocess.run([sys.executable, "-m", "vaccel.cli", "--version"], capture_output=True, text=True, timeout=30)
    import vaccel

    assert r.returncode == 0 and r.stdout == f"vaccel {vaccel.__version__} ({os.path.dirname(vaccel.__file__)})\n"


def test_no_broker_names_both_places_looked_and_what_a_wrong_path_is(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("VACCEL_SOCKET", "XDG_RUNTIME_DIR")}
    cli = [sys.executable, "-m", "vaccel.cli", "status"]
    if os.geteuid() == 0:  # as a user without a broker of their own and none on the system
        if not os.path.exists("/run/vaccel/brokerd.sock"):
            r = subprocess.run(cli, user="nobody", env={**env, "HOME": "/"}, cwd="/", capture_output=True,
                               text=True, timeout=30)
            said = one_line(r, 69)
            assert "no socket at /run/vaccel/brokerd.sock (the system's broker) nor at /tmp/vaccel-" in said
    r = subprocess.run(cli, env={**env, "VACCEL_SOCKET": "/etc/passwd"}, capture_output=True, text=True, timeout=30)
    assert "at /etc/passwd: that is a file, not a broker's socket" in one_line(r, 69)
    stray = tmp_path / "stray.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(stray))
        r = subprocess.run(cli, env={**env, "VACCEL_SOCKET": str(stray)}, capture_output=True, text=True, timeout=30)
    assert f"a socket is there, but not a vaccel broker's (no {stray}.id beside it)" in one_line(r, 69)


def test_leases_show_time_left_reservations_ending_leases_and_waiting_requests(broker: Broker):
    reserved = json.loads(broker.vaccel("reserve", "--gpus", "3", "--time", "1h", "--json").stdout)
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--", "sleep", "60"],
                              env=broker.env, stderr=subprocess.DEVNULL)
    waiter = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "--gpus", "2", "--", "true"],
                              env=broker.env, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(leased(broker)) == 4 and status(broker)["queue"])
        r = broker.vaccel("release", holder_lease(broker, holder.pid), "--grace", "10m")
        assert r.returncode == 0, r.stderr
        text = broker.vaccel("leases").stdout
        header, *rows = text.splitlines()
        assert header.split() == ["LEASE", "USER", "PID", "DEVICES", "SINCE", "LEFT", "STATE", "COMMAND"]
        mine = next(row for row in rows if row.startswith(reserved["lease_id"]))
        assert "(reserved)" in mine and re.search(r"  59m\d\ds  active +vaccel reserve$", mine), mine
        ending = next(row for row in rows if str(holder.pid) in row)
        said = r"  9m\d\ds +ending: released by its holder \(ends at \d\d:\d\d:\d\d\)  sleep 60$"
        assert re.search(said, ending), ending
        assert "waiting:" in rows and any(f"pid {waiter.pid} wants 2 GPUs: position 1 of 1" in row for row in rows)
        listed = json.loads(broker.vaccel("leases", "--json").stdout)
        assert [w["requester"]["pid"] for w in listed["waiting"]] == [waiter.pid]
    finally:
        for proc in (waiter, holder):
            proc.terminate()
            proc.wait(10)


def holder_lease(broker: Broker, pid: int) -> str:
    return next(d["lease_id"] for d in status(broker)["devices"] if d["holder"] and d["holder"]["pid"] == pid)


def test_a_second_release_of_the_same_lease_is_not_an_error(broker: Broker):
    lease_id = json.loads(broker.vaccel("reserve", "--json").stdout)["lease_id"]
    first = broker.vaccel("release", lease_id)
    assert first.returncode == 0
    assert first.stdout == f"{lease_id}: released by its holder; 1 device(s) back in the pool\n"
    again = broker.vaccel("release", lease_id)
    assert again.returncode == 0 and again.stdout == f"{lease_id} had already ended: released by its holder\n"
    assert broker.vaccel("release", "l-nonexistent").returncode == 1  # a lease never known is still a mistake


def test_drain_records_who_and_when_and_says_what_it_replaced_or_found(broker: Broker):
    r = broker.vaccel("drain", "gpu3", "--reason", "fan")
    assert r.returncode == 0 and re.fullmatch(rf"gpu3 \(Tesla T4\) drained: {drained_by_me('fan')}; no new leases\n",
                                               r.stdout), r.stdout
    r = broker.vaccel("drain", "gpu3", "--reason", "fan, again")
    assert "; replaces the earlier drain: fan [" in r.stdout, r.stdout
    r = broker.vaccel("drain", "gpu3", "--undo")
    assert r.stdout.startswith("gpu3 (Tesla T4) is back in the pool: free (it was drained: fan, again ["), r.stdout
    r = broker.vaccel("drain", "gpu3", "--undo")
    assert r.returncode == 0 and r.stdout == "gpu3 (Tesla T4) was not drained: nothing to undo (free)\n"


def test_status_json_keeps_one_key_order_and_no_utilisation_for_simulated_devices(broker: Broker):
    holder = subprocess.Popen([broker.python, "-m", "vaccel.cli", "run", "-q", "--", "sleep", "30"],
                              env=broker.env, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: leased(broker))
        devices = status(broker)["devices"]
        assert len({tuple(d) for d in devices}) == 1, [list(d) for d in devices]  # leased and free alike
        assert all(d["utilization"] is None for d in devices)  # the simulated probe measures none
    finally:
        holder.terminate()
        holder.wait(10)


def test_an_unknown_config_key_gets_its_line_and_the_key_meant(tmp_path: Path):
    config = tmp_path / "brokerd.toml"
    config.write_text('[server]\nsocket_mode = "0666"\n\n[leases]\nheartbeat_tll = "30s"\n')
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    assert str(refused.value) == f"{config}:5: unknown key 'leases.heartbeat_tll'; did you mean 'leases.heartbeat_ttl'?"


def test_a_host_without_a_gpu_offers_no_cpu_unless_configured():
    assert Config().offer_cpu is False
    snapshot = inventory_source(Config())()
    if any(d.vendor != "cpu" for d in snapshot.devices):
        pytest.skip("this host has a GPU")
    assert snapshot.devices == ()
    assert "the CPU is not offered" in snapshot.verdicts[-1].reason and "offer_cpu" in snapshot.verdicts[-1].reason
    gpu_nodes = any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))
    if not gpu_nodes:
        assert [d.vendor for d in inventory_source(Config(offer_cpu=True))().devices] == ["cpu"]


@pytest.mark.skipif(os.geteuid() != 0, reason="real users need root")
def test_a_revoke_is_said_once_naming_the_admin_by_name(root_broker: Broker, staged: Path):  # noqa: F811
    holder, lease_id = alice_holds_a_gpu(root_broker, staged)
    r = root_broker.vaccel("release", lease_id, "--reason", "maintenance")
    assert r.returncode == 0 and r.stdout.startswith(f"{lease_id}: revoked by root: maintenance;"), r.stdout
    assert holder.wait(30) == 143
    said = holder.stderr.read()
    assert f"lease {lease_id} ended: revoked by root: maintenance; stopping the command" in said, said
    assert "has ended" not in said and "uid" not in said
    ended = json.loads(as_user(root_broker, staged, "vaccel-alice", "leases", "--ended", "--json").stdout)
    assert [lease["end_reason"] for lease in ended["leases"]] == ["revoked by root: maintenance"]
