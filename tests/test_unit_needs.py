"""What each feature needs from the systemd unit, and the refusal of a feature the running
unit blocks (brokerd/daemon/unit_needs.py, brokerd/base/confinement.py; issue 41).

The blocks are reproduced with the kernel's own means, without systemd: a bounding set
without the capability (`setpriv --bounding-set`, what CapabilityBoundingSet= does), a
network namespace of its own (`unshare -n`, what PrivateNetwork=yes does) and a read-only
bind mount (`unshare -m` + `mount -o remount,bind,ro`, what ProtectSystem=strict does). A
real daemon runs under each and must refuse the feature with one line naming the setting,
and keep serving leases. Needs root; the booted systemd test (tests/test_systemd_boot.py)
runs the same features under the real unit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.testbeds.broker import DEFAULT_CONFIG, Broker
from brokerd.config.loader import Config, load_config
from brokerd.daemon.unit_needs import needs, render_dropin, write_dropin
from tests.test_multiuser import wait_for

ROOT = Path(__file__).resolve().parent.parent
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="setpriv, unshare and mount need root")
NO_PTRACE = ["setpriv", "--bounding-set", "-all,+kill", "--inh-caps", "-all", "--"]


def config_of(tmp_path: Path, text: str) -> Config:
    """The service's paths whoever runs the test (a user's own broker defaults elsewhere)."""
    path = tmp_path / "brokerd.toml"
    path.write_text(textwrap.dedent(text))
    return load_config(path, {"socket": Path("/run/vaccel/brokerd.sock"), "state_dir": Path("/var/lib/vaccel")})


def test_the_default_configuration_needs_nothing_beyond_the_unit(tmp_path: Path):
    config = config_of(tmp_path, "")
    assert needs(config) == []
    assert "# Nothing: the configuration turns on no feature that needs more." in render_dropin(config)


def test_each_feature_gets_its_lines_with_the_reason(tmp_path: Path):
    mapping = tmp_path / "job-mapping"
    config = config_of(tmp_path, f"""
        [web]
        listen = "127.0.0.1:8642"
        [metrics]
        listen = "0.0.0.0:9400"
        hpc_job_mapping_dir = "{mapping}"
    """)
    text = render_dropin(config)
    blocks = {b.split("\n", 1)[0]: b for b in text.split("\n\n")[1:]}
    web = blocks["# web.listen: the dashboard listens on 127.0.0.1:8642 (TCP; NETLINK: whose connection it is)"]
    assert "RestrictAddressFamilies=AF_INET AF_INET6 AF_NETLINK\nPrivateNetwork=no" in web
    metrics = blocks["# metrics.listen: Prometheus scrapes 0.0.0.0:9400 (TCP; NETLINK: whose connection it is)"]
    assert "PrivateNetwork=no" in metrics
    (job,) = [b for b in blocks if b.startswith("# metrics.hpc_job_mapping_dir")]
    assert blocks[job].endswith(f"ReadWritePaths={mapping}\n")
    assert "CapabilityBoundingSet" not in text  # none of these needs a capability
    dropin = tmp_path / "unit.d" / "50-features.conf"
    assert write_dropin(config, dropin) is True
    assert mapping.is_dir()  # ReadWritePaths= needs the folder before the unit starts
    assert stat.S_IMODE(dropin.stat().st_mode) == 0o644
    assert write_dropin(config, dropin) is False  # unchanged: not rewritten


def test_the_command_line_writes_the_dropin_and_names_the_next_step(tmp_path: Path):
    config = tmp_path / "brokerd.toml"
    config.write_text('[web]\nlisten = "127.0.0.1:8642"\n')
    run = subprocess.run([sys.executable, "-m", "brokerd", "write-unit-dropin", "--config", str(config),
                          "--dest", str(tmp_path / "system")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    dropin = tmp_path / "system" / "vaccel-brokerd.service.d" / "50-features.conf"
    assert "systemctl daemon-reload && systemctl restart vaccel-brokerd" in run.stdout
    assert "PrivateNetwork=no" in dropin.read_text()
    config.write_text("not_a_key = 1\n")
    run = subprocess.run([sys.executable, "-m", "brokerd", "write-unit-dropin", "--config", str(config),
                          "--dest", str(tmp_path / "system")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "left as it was" in run.stderr
    assert "PrivateNetwork=no" in dropin.read_text()


# -- detection, under the kernel's own confinement ---------------------------------------


def probe(prefix: list[str], code: str) -> str:
    run = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@root_only
def test_a_bounding_set_without_ptrace_is_named():
    code = ("from brokerd.daemon.unit_needs import Need, blocks\n"
            "print(blocks(Need('enforce.mode', '', capabilities=('CAP_SYS_PTRACE', 'CAP_DAC_READ_SEARCH'))))\n"
            "print(blocks(Need('x', '', capabilities=('CAP_KILL',))))")
    assert probe(NO_PTRACE, code).splitlines() == [
        "['CapabilityBoundingSet= lacks CAP_SYS_PTRACE CAP_DAC_READ_SEARCH']", "[]"]
    assert probe([], code).splitlines() == ["[]", "[]"]


@root_only
def test_a_private_network_and_setuid_without_the_capability_are_named():
    code = ("from brokerd.daemon.unit_needs import Need, blocks\n"
            "print(blocks(Need('slurm.mode', '', capabilities=('CAP_SETUID', 'CAP_SETGID'), "
            "families=('AF_INET',), network=True, syscalls=('@setuid',))))")
    assert probe(["unshare", "-n", "--"], code) == "['PrivateNetwork=yes']"
    assert probe(["setpriv", "--bounding-set", "-all,+kill", "--"], code) == (
        "['CapabilityBoundingSet= lacks CAP_SETUID CAP_SETGID', 'SystemCallFilter= blocks @setuid']")
    assert probe([], code) == "[]"


@root_only
def test_a_read_only_folder_is_named(tmp_path: Path):
    folder = tmp_path / "mapping"
    folder.mkdir()
    code = (f"from pathlib import Path\nfrom brokerd.daemon.unit_needs import Need, blocks\n"
            f"print(blocks(Need('metrics.hpc_job_mapping_dir', '', writes=(Path('{folder}'), Path('{folder}/sub')))))")
    read_only = ["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
                 f'mount --bind "{folder}" "{folder}" && mount -o remount,bind,ro "{folder}" && exec "$@"', "sh"]
    assert probe(read_only, code) == f"['ReadWritePaths= lacks {folder}', 'ReadWritePaths= lacks {folder}/sub']"
    assert probe([], code) == "[]"


# -- a real daemon refuses what its confinement blocks ---------------------------------


class ConfinedBroker(Broker):
    def __init__(self, workdir: Path, config_text: str, prefix: list[str]) -> None:
        super().__init__(workdir, ROOT / "examples" / "lab-server.yaml", config_text)
        self.prefix = prefix

    def command(self) -> list[str]:
        return [*self.prefix, *super().command()]


@pytest.fixture
def workdir() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="vaccel-unit-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refusals(broker: Broker) -> list[str]:
    return [line for line in broker.log.read_text().splitlines() if " refused at " in line]


@root_only
def test_a_dashboard_in_a_private_network_is_refused_not_served(workdir: Path):
    port = free_port()
    config = DEFAULT_CONFIG + f'[web]\nlisten = "127.0.0.1:{port}"\n[metrics]\nlisten = "127.0.0.1:{port + 1}"\n'
    broker = ConfinedBroker(workdir, config, ["unshare", "-n", "--"]).start()
    try:
        status = broker.vaccel("status", "--json")  # leases are served across the namespace
        assert status.returncode == 0, status.stderr
        assert len(json.loads(status.stdout)["devices"]) == 4
        lines = refusals(broker)
        assert len(lines) == 2, broker.log.read_text()
        for feature, line in zip(("web.listen", "metrics.listen"), lines, strict=True):
            assert f"{feature} refused at start: the unit vaccel-brokerd.service blocks it (PrivateNetwork=yes)" in line
            assert "vaccel-brokerd write-unit-dropin && systemctl daemon-reload" in line
        log = broker.log.read_text()
        assert "dashboard on" not in log and "metrics served on" not in log
        # A reload says it again, once per feature, and the broker keeps serving.
        broker.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: len(refusals(broker)) == 4, 30)
        assert all("refused at reload" in line for line in refusals(broker)[2:])
        assert "need a restart" not in broker.log.read_text()
        assert broker.vaccel("status").returncode == 0
    finally:
        broker.stop()


@root_only
def test_enforcement_without_ptrace_is_refused(workdir: Path):
    pytest.importorskip("posix1e", reason="pylibacl is not installed (scripts/setup.sh installs vaccel[enforce])")
    nodes = workdir / "dev"
    nodes.mkdir()
    inventory = workdir / "inventory.yaml"
    lines = ["devices:"]
    for n, minor in enumerate((7, 5)):  # /dev/full and /dev/zero's numbers: openable, held by nobody
        os.mknod(nodes / f"gpu{n}", stat.S_IFCHR | 0o660, os.makedev(1, minor))
        lines.append(f"  - {{vendor: nvidia, name: sim, uuid: GPU-unit-{n}, memory_mib: 1024, "
                     f"device_nodes: [{nodes / f'gpu{n}'}]}}")
    inventory.write_text("\n".join(lines) + "\n")
    broker = ConfinedBroker(workdir, DEFAULT_CONFIG + '[enforce]\nmode = "acl"\n', NO_PTRACE)
    broker.inventory = inventory
    broker.start()
    try:
        assert broker.vaccel("status").returncode == 0
        (line,) = refusals(broker)
        assert ("enforce.mode refused at start: the unit vaccel-brokerd.service blocks it "
                "(CapabilityBoundingSet= lacks CAP_SYS_PTRACE CAP_DAC_READ_SEARCH)") in line
        assert "enforcement on" not in broker.log.read_text()
    finally:
        broker.stop()


def test_a_client_whose_uid_the_kernel_does_not_tell_is_keyed_by_its_ipv4_address(monkeypatch):
    """Seen under the real unit (the boot test): without AF_NETLINK the sock_diag lookup
    fails, and the dashboard's guard fell back to the address, where an IPv4 address has no
    ipv4_mapped: every request died in connection_made. The fallback path, on a real socket."""
    from brokerd.addons import http_guard

    monkeypatch.setattr(http_guard, "peer_uid", lambda local, peer: None)  # what a refused netlink answers
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            accepted, _ = server.accept()
            with accepted:
                assert http_guard._client_key(accepted) == "address 127.0.0.1"
                assert client.fileno() >= 0
