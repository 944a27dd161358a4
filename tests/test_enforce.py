"""Leases enforced by the kernel (`[enforce] mode = "acl"`, brokerd/addons/enforce/), tested with real
Unix users, real POSIX ACLs and real character device nodes.

The nodes are made with mknod in a temp dir under /tmp (ext4 here; tmpfs takes ACLs too),
with the numbers of /dev/full (1,7), /dev/zero (1,5) and /dev/random (1,8) so that opening
them works and hardly any process on the host holds one open already (the openers scan
goes by device number, so /dev/null's would find every daemon's stdin). The kernel
decides every open here: a user without an entry gets EACCES from open(2) itself.

Needs root (useradd, mknod, a daemon that sets ACLs on root's nodes) and pylibacl; skips
loudly otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from brokerd.addons.enforce.openers import _by_mapping, find_openers, first_login_uid
from brokerd.config.loader import ConfigError, load_config
from brokerd.devices.model import Device
from brokerd.devices.nodes import gate_problem, node_id, node_problem, ungated
from brokerd.devices.probes.simulated import InventoryError, parse_inventory
from tests.conftest import Broker, alive
from tests.test_multiuser import _ensure_user, as_user, staged, status, wait_for  # noqa: F401 - staged: fixture

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="enforcement tests need root: useradd, mknod, ACLs on root's nodes"),
]
acl = pytest.importorskip("brokerd.addons.enforce.acl")
pytest.importorskip("posix1e", reason="pylibacl is not installed (scripts/setup.sh installs vaccel[enforce])")

ALICE, BOB = "vaccel-alice", "vaccel-bob"
FULL, ZERO, RANDOM = 7, 5, 8  # minors of major 1 (mem): openable, and nobody keeps them open


@pytest.fixture(scope="module")
def users() -> dict[str, int]:
    import pwd

    for name in (ALICE, BOB):
        _ensure_user(name)
    return {name: pwd.getpwnam(name).pw_uid for name in (ALICE, BOB)}


@pytest.fixture
def nodes() -> Iterator[Path]:
    """A folder every user may traverse, for nodes, scripts and markers."""
    folder = Path(tempfile.mkdtemp(prefix="vaccel-enf-"))
    os.chmod(folder, 0o755)
    (folder / "markers").mkdir(mode=0o1777)
    os.chmod(folder / "markers", 0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def mknod(folder: Path, name: str, minor: int, mode: int = 0o660) -> str:
    path = folder / name
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(1, minor))
    os.chmod(path, mode)  # mknod's mode is masked by the umask
    return str(path)


def only_as(user: str) -> dict[str, object]:
    """subprocess arguments that run as `user` with their own groups only: `user=` alone
    keeps root's groups, and group root may open the nodes by their mode."""
    import pwd

    return {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}


def vaccel_as(broker: Broker, staged: Path, user: str, *args: str, **kwargs):  # noqa: F811 - staged: fixture
    """tests.test_multiuser.as_user, with the user's own groups only."""
    groups = {k: v for k, v in only_as(user).items() if k != "user"}
    return as_user(broker, staged, user, *args, **groups, **kwargs)


def try_open(user: str, path: str) -> str:
    """What open(2) says to `user` opening `path` read-write: "opened" or the errno name."""
    code = ("import errno, os, sys\ntry:\n    os.close(os.open(sys.argv[1], os.O_RDWR))\n    print('opened')\n"
            "except OSError as e:\n    print(errno.errorcode[e.errno])\n")
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=30,
                       cwd="/", env={"PATH": "/usr/bin:/bin"}, **only_as(user))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


# -- the parts, on real nodes ----------------------------------------------------------


def test_an_acl_entry_opens_the_node_for_that_user_alone(users: dict[str, int], nodes: Path):
    node = mknod(nodes, "gpu0", FULL)
    assert (try_open(ALICE, node), try_open(BOB, node)) == ("EACCES", "EACCES")
    assert acl.set_users(node, {users[ALICE]}) == ({users[ALICE]}, set())
    assert (try_open(ALICE, node), try_open(BOB, node)) == ("opened", "EACCES")
    assert acl.set_users(node, {users[ALICE]}) == (set(), set())  # nothing to change: nothing written
    assert acl.set_users(node, set()) == (set(), {users[ALICE]})
    assert try_open(ALICE, node) == "EACCES"
    # Back to a minimal ACL: the node has its plain mode again.
    assert acl.users(node) == set()
    assert stat.S_IMODE(os.stat(node).st_mode) == 0o660


def test_only_named_user_entries_are_touched(users: dict[str, int], nodes: Path):
    import posix1e

    node = mknod(nodes, "gpu0", FULL, mode=0o600)
    group = posix1e.ACL(file=node)
    entry = group.append()
    entry.tag_type, entry.qualifier = posix1e.ACL_GROUP, 0
    entry.permset.add(posix1e.ACL_READ)
    group.calc_mask()
    group.applyto(node)
    acl.set_users(node, {users[ALICE], users[BOB]})
    acl.set_users(node, {users[BOB]})
    text = posix1e.ACL(file=node).to_any_text(options=posix1e.TEXT_NUMERIC_IDS).decode()
    assert f"user:{users[BOB]}:rw-" in text and f"user:{users[ALICE]}:" not in text
    assert "group:0:r--" in text and "group::---" in text  # the admin's entries stay as they were
    assert (try_open(ALICE, node), try_open(BOB, node)) == ("EACCES", "opened")


def test_openers_are_found_by_device_number_and_owner(users: dict[str, int], nodes: Path):
    node = mknod(nodes, "gpu0", FULL)
    other = mknod(nodes, "gpu1", ZERO)
    acl.set_users(node, {users[ALICE]})
    code = "import os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\nprint('open', flush=True)\ntime.sleep(60)\n"
    holder = subprocess.Popen([sys.executable, "-c", code, node], stdout=subprocess.PIPE, text=True,
                              cwd="/", env={"PATH": "/usr/bin:/bin"}, **only_as(ALICE))
    try:
        assert holder.stdout.readline().strip() == "open"
        ids = [node_id(node), node_id(other)]
        (found,) = [o for o in find_openers(ids) if o.process.pid == holder.pid]
        assert (found.uid, found.user, found.nodes) == (users[ALICE], ALICE, (node,))
        assert found.command.startswith("python")
        assert [o.process.pid for o in find_openers(ids, uid=users[ALICE])] == [holder.pid]
        assert find_openers(ids, uid=users[BOB]) == []
        assert find_openers([node_id(other)], only=[holder.pid]) == []
    finally:
        holder.kill()
        holder.wait(10)


def test_a_mapping_kept_after_close_counts_as_holding_the_node(tmp_path: Path, nodes: Path):
    """/proc/PID/maps names the node's own filesystem and inode (the real kernel's format,
    written out here: no char device of major 1 keeps a mapping on its node)."""
    node = node_id(mknod(nodes, "gpu0", FULL))
    assert node is not None
    line = (f"7f0000000000-7f0000200000 rw-s 00000000 {os.major(node.dev):02x}:{os.minor(node.dev):02x} "
            f"{node.ino}                    {node.path}\n")
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "maps").write_text("55d0c0000000-55d0c0021000 r--p 00000000 fd:01 131 /usr/bin/python3\n" + line)
    key = (os.major(node.dev), os.minor(node.dev), node.ino)
    assert _by_mapping(77, {key: node.path}, tmp_path) == {node.path}
    assert _by_mapping(77, {(0, 1, 2): node.path}, tmp_path) == set()


def _device(index: int, nodes: tuple[str, ...] = (), vendor: str = "nvidia") -> Device:
    return Device(index=index, uuid=f"GPU-{index}", vendor=vendor, name="sim", memory_mib=1, backend="x",
                  device_nodes=nodes)


def test_what_cannot_gate_a_device_fails_closed(nodes: Path):
    good = mknod(nodes, "gpu0", FULL)
    open_to_all = mknod(nodes, "gpu1", ZERO, mode=0o666)
    (nodes / "file").write_text("")
    (nodes / "link").symlink_to(good)
    assert node_problem(good) == ""
    assert node_problem(str(nodes / "missing")) == f"{nodes}/missing not found"
    assert "not a character device node" in node_problem(str(nodes / "file"))
    assert "not a character device node" in node_problem(str(nodes / "link"))  # ACLs follow links: refused
    assert "is mode 0666: every user can open it" in node_problem(open_to_all)
    assert gate_problem(_device(0)) == "no device node found for it"
    assert gate_problem(_device(0, (good, open_to_all))).startswith(open_to_all)
    held = ungated([_device(0, (good,)), _device(1), _device(2, (str(nodes / "missing"),)),
                    _device(3, vendor="cpu")])
    assert set(held) == {"GPU-1", "GPU-2"}  # the CPU pseudo-device has nothing to gate: not held back
    assert "never granted while enforcement is on" in held["GPU-2"]


def test_simulated_inventory_carries_device_nodes():
    base = "devices:\n  - {vendor: nvidia, name: A, uuid: U%d, memory_mib: 1, device_nodes: %s}\n"
    (device,) = parse_inventory(base % (0, "[/dev/nvidia0]"))
    assert device.device_nodes == ("/dev/nvidia0",)
    with pytest.raises(InventoryError, match="absolute paths"):
        parse_inventory(base % (0, "[nvidia0]"))
    twice = base % (0, "[/dev/x]") + (base % (1, "[/dev/x]")).removeprefix("devices:\n")
    with pytest.raises(InventoryError, match="listed for more than one device"):
        parse_inventory(twice)


def test_config_enforce_section(tmp_path: Path):
    path = tmp_path / "brokerd.toml"
    path.write_text('[enforce]\nmode = "acl"\ngrace = "3s"\n')
    config = load_config(path)
    assert (config.enforce_mode, config.enforce_grace_s) == ("acl", 3.0)
    assert load_config(None).enforce_mode == "off"
    path.write_text('[enforce]\nmode = "on"\n')
    with pytest.raises(ConfigError, match=r"enforce\.mode must be 'off' or 'acl'"):
        load_config(path)
    assert first_login_uid(tmp_path / "no-login.defs") == 1000


# -- a real daemon as root --------------------------------------------------------------

KEEPER = textwrap.dedent("""\
    # Keeps a node open, outside `vaccel run`'s reach (its own session); a SIGTERM is written down.
    import os, signal, sys, time
    node, marker = sys.argv[1], sys.argv[2]
    fd = os.open(node, os.O_RDWR)
    def term(signum, frame):
        # Written aside and renamed, so the marker never exists empty (the test reads it once it exists).
        with open(marker + ".part", "w") as f:
            f.write("SIGTERM")
        os.rename(marker + ".part", marker)
        os._exit(0)
    signal.signal(signal.SIGTERM, term)
    print(os.getpid(), flush=True)
    while True:
        time.sleep(1)
""")

HOLDER = textwrap.dedent("""\
    # The command of `vaccel run`: opens its own device's node, leaves a keeper holding it,
    # and exits (so the lease is released) once the test says so.
    import json, os, subprocess, sys, time
    folder = sys.argv[1]
    node = json.load(open(os.path.join(folder, "nodes.json")))[os.environ["VACCEL_DEVICES"]]
    os.close(os.open(node, os.O_RDWR))
    keeper = subprocess.Popen([sys.executable, os.path.join(folder, "keeper.py"), node,
                               os.path.join(folder, "markers", "keeper")],
                              start_new_session=True, stdout=subprocess.PIPE, text=True)
    keeper.stdout.readline()
    print(json.dumps({"lease": os.environ["VACCEL_LEASE_ID"], "node": node, "keeper": keeper.pid}), flush=True)
    while not os.path.exists(os.path.join(folder, "markers", "release")):
        time.sleep(0.05)
""")


def _inventory(folder: Path, nodes: dict[str, str]) -> Path:
    lines = ["devices:"]
    for index, (uuid, node) in enumerate(nodes.items()):
        lines.append(f"  - {{vendor: nvidia, name: Sim {index}, uuid: {uuid}, memory_mib: 1024, "
                     f"compute_capability: '8.0', device_nodes: [{node}]}}")
    path = folder / "inventory.yaml"
    path.write_text("\n".join(lines) + "\n")
    (folder / "nodes.json").write_text(json.dumps(nodes))
    for name, text in (("keeper.py", KEEPER), ("holder.py", HOLDER)):
        (folder / name).write_text(text)
    for path_ in folder.iterdir():
        if path_.is_file():
            os.chmod(path_, 0o644)
    return path


CONFIG = """
[leases]
heartbeat_ttl = "5s"
[probe]
refresh_interval = "1s"
{probe}
[enforce]
mode = "acl"
grace = "1s"
"""


@pytest.fixture
def gated(users: dict[str, int], staged: Path, nodes: Path, start_broker):  # noqa: F811 - staged: fixture
    """start(devices) -> (broker, {uuid: node}); `devices` maps a uuid to the minor of a node
    to make, a node path already made, or None for a path that does not exist."""

    def path(uuid: str, node: int | str | None) -> str:
        if isinstance(node, int):
            return mknod(nodes, uuid, node)
        return node if node is not None else str(nodes / f"{uuid}-missing")

    started: list[tuple[Broker, Path]] = []

    def start(devices: dict[str, int | str | None], probe: str = "") -> tuple[Broker, dict[str, str]]:
        paths = {uuid: path(uuid, node) for uuid, node in devices.items()}
        workdir = Path(tempfile.mkdtemp(prefix="vaccel-enf-b-"))
        os.chmod(workdir, 0o755)  # the users' clients must reach the socket
        broker = start_broker(_inventory(nodes, paths), CONFIG.format(probe=probe), workdir=workdir)
        started.append((broker, workdir))
        return broker, paths

    yield start
    for broker, workdir in started:  # stopped before its folder goes (start_broker stops it later too)
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_holder_opens_others_are_refused_and_the_end_closes_and_stops(
    gated, users: dict[str, int], staged: Path, nodes: Path  # noqa: F811 - staged: fixture
):
    broker, _ = gated({"GPU-e0": FULL, "GPU-e1": ZERO})
    shown = status(broker)
    assert shown["enforcement"] == "acl"
    assert [(d["gated"], d["device_nodes"]) for d in shown["devices"]] == [
        (True, [str(nodes / "GPU-e0")]), (True, [str(nodes / "GPU-e1")])]
    run = vaccel_as(broker, staged, ALICE, "run", "-q", "--", sys.executable, str(nodes / "holder.py"), str(nodes),
                  popen=True)
    try:
        line = run.stdout.readline()
        assert line, run.stderr.read()
        info = json.loads(line)
        node, other = info["node"], next(p for p in json.loads((nodes / "nodes.json").read_text()).values()
                                          if p != info["node"])
        # While the lease holds: the kernel opens its node to alice alone, and no other node to her.
        assert try_open(ALICE, node) == "opened"
        assert try_open(BOB, node) == "EACCES"
        assert try_open(ALICE, other) == "EACCES"
        assert acl.users(node) == {users[ALICE]}
        (nodes / "markers" / "release").touch()
        assert run.wait(30) == 0, run.stderr.read()
    finally:
        if run.poll() is None:
            run.kill()
    # Released: the entry is gone, and the keeper that still had the node open is stopped.
    assert try_open(ALICE, node) == "EACCES"
    assert acl.users(node) == set()
    marker = nodes / "markers" / "keeper"
    wait_for(marker.exists)
    assert marker.read_text() == "SIGTERM"
    log = broker.log.read_text()
    assert f"SIGTERM to {ALICE}'s pid {info['keeper']}" in log
    assert f"closed to {ALICE} (lease released)" in log


def test_restart_after_kill9_reconciles_the_nodes_with_the_leases(
    gated, users: dict[str, int], staged: Path, nodes: Path  # noqa: F811 - staged: fixture
):
    broker, paths = gated({"GPU-k0": FULL, "GPU-k1": ZERO})
    holder = vaccel_as(broker, staged, ALICE, "run", "-q", "--", "sh", "-c", "echo $VACCEL_DEVICES; sleep 120",
                     popen=True)
    try:
        uuid = holder.stdout.readline().strip()
        assert uuid in paths, holder.stderr.read() if holder.poll() is not None else uuid
        mine, other = paths[uuid], next(p for u, p in paths.items() if u != uuid)
        broker.kill9()
        # While it is down: bob's entries appear (left over from some crash) and alice's is lost.
        acl.set_users(mine, {users[BOB]})
        acl.set_users(other, {users[BOB]})
        assert try_open(BOB, mine) == "opened"
        broker.start()  # returns once it serves: the reconcile came before
        assert (acl.users(mine), acl.users(other)) == ({users[ALICE]}, set())
        assert (try_open(ALICE, mine), try_open(BOB, mine), try_open(BOB, other)) == ("opened", "EACCES", "EACCES")
        log = broker.log.read_text()
        assert f"removed the ACL entry of {BOB} on {mine}: no lease there" in log
        assert f"put back the ACL entry of {ALICE} on {mine}" in log
        assert any(d["holder"] and d["holder"]["user"] == ALICE for d in status(broker)["devices"])
    finally:
        holder.terminate()
        holder.wait(30)


def test_a_device_whose_node_cannot_be_found_is_never_granted(
    gated, users: dict[str, int], staged: Path, nodes: Path  # noqa: F811 - staged: fixture
):
    broker, paths = gated({"GPU-m0": FULL, "GPU-m1": None})
    missing = paths["GPU-m1"]
    gpu0, gpu1 = status(broker)["devices"]
    assert (gpu0["gated"], gpu1["gated"]) == (True, False)
    assert gpu1["gate_reason"] == f"{missing} not found"
    assert gpu1["state"] == "busy"  # held back from the queue, not only refused at the grant
    shown = broker.vaccel("status")
    assert f"NOT GATED: {missing} not found" in shown.stdout and "1 of 2 devices gated" in shown.stdout
    r = vaccel_as(broker, staged, ALICE, "run", "--gpus", "2", "--no-wait", "--", "true")
    assert r.returncode != 0
    for _ in range(3):  # whatever the selection's order, one device is all there is
        r = vaccel_as(broker, staged, ALICE, "run", "-q", "--", "sh", "-c", "echo $VACCEL_DEVICES")
        assert (r.returncode, r.stdout.strip()) == (0, "GPU-m0"), r.stderr
    assert "granted GPU-m1" not in broker.log.read_text()


def test_a_failed_acl_fails_the_grant_and_undoes_the_rest(
    gated, users: dict[str, int], staged: Path, nodes: Path  # noqa: F811 - staged: fixture
):
    broker, paths = gated({"GPU-r0": FULL, "GPU-r1": ZERO})
    frozen = paths["GPU-r1"]  # equal devices are chosen in index order: its ACL is set second
    # A read-only bind mount over one node: its ACL cannot be set, as on a filesystem without them.
    if subprocess.run(["mount", "--bind", "-o", "ro", frozen, frozen], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (no CAP_SYS_ADMIN): the refusal of a grant is not tested")
    try:
        r = vaccel_as(broker, staged, ALICE, "run", "--gpus", "2", "--no-wait", "--", "true")
        assert r.returncode != 0
        assert "could not make the grant real" in r.stderr and "Read-only file system" in r.stderr, r.stderr
        assert acl.users(paths["GPU-r0"]) == set()  # the entry added before the failure is gone
        assert try_open(ALICE, paths["GPU-r0"]) == "EACCES"
        assert all(d["lease_id"] is None for d in status(broker)["devices"])
    finally:
        subprocess.run(["umount", frozen], check=True)


def test_a_process_that_opened_a_node_before_enforcement_is_reported_and_stopped(
    gated, users: dict[str, int], nodes: Path
):
    node = mknod(nodes, "early", FULL)
    marker = nodes / "markers" / "early"
    # Opened as root, then the process becomes bob: the node was open before the broker began.
    code = textwrap.dedent(f"""\
        import os, signal, sys, time
        fd = os.open({node!r}, os.O_RDWR)
        os.setgid({users[BOB]}); os.setuid({users[BOB]})
        def term(signum, frame):  # written aside and renamed: the marker never exists empty
            with open({str(marker) + ".part"!r}, "w") as f:
                f.write("SIGTERM")
            os.rename({str(marker) + ".part"!r}, {str(marker)!r})
            os._exit(0)
        signal.signal(signal.SIGTERM, term)
        print(os.getuid(), flush=True)
        while True:
            time.sleep(1)
    """)
    early = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd="/",
                             env={"PATH": "/usr/bin:/bin"})
    try:
        assert early.stdout.readline().strip() == str(users[BOB])
        broker, _ = gated({"GPU-u0": node}, probe='unleased_processes = "signal"\nunleased_grace = "0s"')
        wait_for(marker.exists)
        assert marker.read_text() == "SIGTERM"
        assert early.wait(10) == 0
        # The gate logs the signal once signal_all has returned: the process may be gone first.
        wait_for(lambda: f"SIGTERM to {BOB}'s pid {early.pid}" in broker.log.read_text())
        log = broker.log.read_text()
        assert f"{BOB}'s pid {early.pid}" in log and "without a lease there" in log
    finally:
        if early.poll() is None:
            early.send_signal(signal.SIGKILL)
            early.wait(10)


def test_changing_the_mode_needs_a_restart(gated):
    broker, _ = gated({"GPU-h0": FULL})
    broker.config.write_text(CONFIG.format(probe="").replace('mode = "acl"', 'mode = "off"'))
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "enforce.mode need a restart" in broker.log.read_text())
    assert status(broker)["enforcement"] == "acl"


def test_after_a_kill9_what_an_ended_lease_left_holding_a_node_is_stopped_before_the_device_is_granted(
    gated, users: dict[str, int], staged: Path, nodes: Path  # noqa: F811 - staged: fixture
):
    """Issue 31 item 7: alice's lease ends while the daemon is down (her `vaccel run` is
    killed), her keeper still holds the node. The restarted daemon used to only report it
    and grant the device to bob at once, shared. Now the keeper is stopped as on any end,
    and bob's request waits until it has let go."""
    broker, paths = gated({"GPU-z0": FULL})
    (node,) = paths.values()
    run = vaccel_as(broker, staged, ALICE, "run", "-q", "--", sys.executable, str(nodes / "holder.py"), str(nodes),
                    popen=True)
    bob = None
    try:
        line = run.stdout.readline()
        assert line, run.stderr.read()
        keeper = json.loads(line)["keeper"]
        broker.kill9()
        run.kill()  # her lease's holder dies while the daemon is down: the lease ends at the restart
        run.wait(10)
        assert alive(keeper)
        broker.start()
        asked = time.monotonic()
        bob = vaccel_as(broker, staged, BOB, "run", "-q", "--", "sh", "-c", "echo granted; sleep 30", popen=True)
        assert bob.stdout.readline().strip() == "granted", bob.stderr.read()
        waited = time.monotonic() - asked
        print(f"\nbob's `vaccel run` was granted {waited:.2f}s after he asked, once the keeper had let go")
        # By the time bob holds the device, alice's keeper has had its SIGTERM and is gone.
        marker = nodes / "markers" / "keeper"
        assert marker.exists() and marker.read_text() == "SIGTERM"
        assert not alive(keeper)
        assert (try_open(ALICE, node), acl.users(node)) == ("EACCES", {users[BOB]})
        log = broker.log.read_text()
        assert f"SIGTERM to {ALICE}'s pid {keeper}" in log and "before this start" in log
    finally:
        for proc in (run, bob):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if alive(keeper):
            os.kill(keeper, signal.SIGKILL)


def bob_holds_open(node: str, users: dict[str, int]) -> subprocess.Popen[str]:
    """A process that opens `node` as root, then becomes bob and keeps it open (opened before
    the broker began: nobody leased it); returned once the node is open."""
    code = textwrap.dedent(f"""\
        import os, time
        fd = os.open({node!r}, os.O_RDWR)
        os.setgid({users[BOB]}); os.setuid({users[BOB]})
        print("open", flush=True)
        time.sleep(120)
    """)
    early = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd="/",
                             env={"PATH": "/usr/bin:/bin"})
    assert early.stdout is not None and early.stdout.readline().strip() == "open"
    return early


def test_a_device_held_open_without_a_lease_names_its_holder_in_status(
    gated, users: dict[str, int], staged: Path, nodes: Path  # noqa: F811 - staged: fixture
):
    """Issue 42: the gate's busy device says who holds it, in `vaccel status` and in its
    JSON (`busy_by`), as a lease's holder is named."""
    node = mknod(nodes, "named", FULL)
    early = bob_holds_open(node, users)
    try:
        broker, _ = gated({"GPU-n0": node})
        (device,) = status(broker)["devices"]
        assert device["state"] == "busy", device
        assert device["busy_by"]["user"] == BOB and device["busy_by"]["pid"] == early.pid, device
        text = broker.vaccel("status").stdout
        assert f"{BOB} (pid {early.pid}, no lease)" in text, text
    finally:
        early.kill()
        early.wait(10)


def test_a_device_held_open_without_a_lease_is_not_granted_until_it_is_let_go(
    gated, users: dict[str, int], staged: Path, nodes: Path  # noqa: F811 - staged: fixture
):
    """The neighbour of the above: with `unleased_processes = "report"` (the default) a
    process of bob's that holds the node without a lease is only reported, and the device
    waits for it rather than being shared with alice."""
    node = mknod(nodes, "held", FULL)
    early = bob_holds_open(node, users)
    try:
        broker, _ = gated({"GPU-y0": node})
        (device,) = status(broker)["devices"]
        assert device["state"] == "busy", device
        r = vaccel_as(broker, staged, ALICE, "run", "--no-wait", "--", "true")
        assert r.returncode != 0 and f"pid {early.pid}" in r.stderr, r.stderr
        early.kill()
        early.wait(10)
        wait_for(lambda: status(broker)["devices"][0]["state"] == "free")
        r = vaccel_as(broker, staged, ALICE, "run", "--no-wait", "--", "true")
        assert r.returncode == 0, r.stderr
    finally:
        if early.poll() is None:
            early.kill()
            early.wait(10)
