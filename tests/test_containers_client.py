"""The client side of `vaccel run -- docker run ...`, without an engine: reading the engine's
command exactly (client/vaccel/containers/engine_command.py), the refusals (containers/rules.py) and the
options that apply a lease (containers/argv.py). tests/test_containers_run.py runs the real thing.
"""

from __future__ import annotations

import csv
import io
import os
import stat
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vaccel.cli import full as cli
from vaccel.containers import options as container_options
from vaccel.containers import rules as container_rules
from vaccel.containers.argv import ContainerLease, LeasedDevice, _csv, apply, container_env
from vaccel.containers.engine_command import ENGINE_PROGRAMS, ContainerRefused, ContainerRun, recognise

from vaccel_common.backends import GPU_NODE_GLOBS, is_gpu_node


def run_of(*argv: str) -> ContainerRun:
    run = recognise(list(argv))
    assert run is not None
    return run


# -- recognising and reading ---------------------------------------------------------------


@pytest.mark.parametrize("argv, engine, image, command", [
    (["docker", "run", "img"], "docker", "img", ()),
    (["/usr/bin/docker", "container", "run", "--rm", "img", "sh", "-c", "x"], "docker", "img", ("sh", "-c", "x")),
    (["podman", "run", "-it", "img", "bash"], "podman", "img", ("bash",)),
    (["/usr/local/bin/podman", "container", "run", "img"], "podman", "img", ()),
    (["docker", "-H", "unix:///x.sock", "run", "img"], "docker", "img", ()),
    (["docker", "--host=tcp://h:2375", "--context", "c", "-D", "--tls", "run", "img"], "docker", "img", ()),
    (["docker", "-c", "ctx", "-l", "debug", "run", "img"], "docker", "img", ()),
    (["podman", "--root", "/r", "--runroot=/rr", "-r", "run", "img"], "podman", "img", ()),
])
def test_recognises_the_engines_run_commands(argv, engine, image, command):
    run = run_of(*argv)
    assert (run.engine, run.image, run.command) == (engine, image, command)


@pytest.mark.parametrize("argv", [
    ["docker", "ps"], ["docker", "container", "ls"], ["docker", "images", "run"], ["podman", "build", "."],
    ["python3", "run"], ["dockerd"], ["mydocker", "run", "img"], ["docker"],
])
def test_other_commands_are_not_container_runs(argv):
    assert recognise(argv) is None


@pytest.mark.parametrize("options, image", [
    (["-itv", "/a:/b"], "img"),  # a cluster whose last letter takes the next word
    (["-p8080:80", "-eA=1"], "img"),  # a short option's value in the same word
    (["-d=false", "--rm=true"], "img"),  # flags with a value after '='
    (["--name=x", "--name", "y"], "img"),
    (["-v", "/data:/data:ro", "--workdir", "/w", "-u", "1000:1000"], "img"),
    (["--network", "none", "--init"], "img"),
    (["--rm", "--"], "img"),  # `--` ends the options
    (["-e", "A", "--env=B=2", "--entrypoint", "/bin/sh"], "img"),
])
def test_reads_every_option_spelling_to_find_the_image(options, image):
    run = run_of("docker", "run", *options, image, "--gpus", "all")
    assert run.image == image
    assert run.command == ("--gpus", "all")  # after the IMAGE: the container's command, not an option


def test_the_options_are_read_as_the_engine_reads_them():
    run = run_of("docker", "run", "-itv", "/a:/b", "-p8080:80", "--rm=false", "-d=false", "--name=x", "img")
    assert [(o.name, o.value) for o in run.options] == [
        ("--interactive", None), ("--tty", None), ("--volume", "/a:/b"), ("--publish", "8080:80"),
        ("--rm", "false"), ("--detach", "false"), ("--name", "x")]
    assert not run.flag("--rm") and not run.detached
    assert run_of("podman", "run", "-dit", "img").detached


def test_the_rebuilt_command_keeps_the_users_words_and_adds_before_the_image():
    argv = ["docker", "-H", "unix:///s", "container", "run", "-itv", "/a:/b", "--", "img", "sh", "-c", "x"]
    assert run_of(*argv).argv(["--X", "y"]) == [
        "docker", "-H", "unix:///s", "container", "run", "-itv", "/a:/b", "--X", "y", "--", "img", "sh", "-c", "x"]


@pytest.mark.parametrize("argv, message", [
    (["docker", "run", "--no-such-option", "img"], "does not know the option --no-such-option"),
    (["docker", "run", "-Z", "img"], "does not know the option -Z"),
    (["docker", "--nope", "run", "img"], "does not know the option --nope"),
    (["docker", "run", "--name"], "--name needs a value"),
    (["docker", "run", "-itv"], "-itv needs a value"),
    (["docker", "run", "--rm"], "names no IMAGE"),
    (["podman", "run", "--gpus=all", "-x", "img"], "does not know the option -x"),
])
def test_what_cannot_be_read_exactly_is_refused(argv, message):
    with pytest.raises(ContainerRefused, match=message):
        recognise(argv)


def test_the_option_tables_agree_with_themselves():
    for value, flags, short in [
        (container_options.DOCKER_RUN_VALUE, container_options.DOCKER_RUN_FLAGS, container_options.DOCKER_RUN_SHORT),
        (container_options.PODMAN_RUN_VALUE, container_options.PODMAN_RUN_FLAGS, container_options.PODMAN_RUN_SHORT),
        (container_options.DOCKER_GLOBAL_VALUE, container_options.DOCKER_GLOBAL_FLAGS,
         container_options.DOCKER_GLOBAL_SHORT),
        (container_options.PODMAN_GLOBAL_VALUE, container_options.PODMAN_GLOBAL_FLAGS,
         container_options.PODMAN_GLOBAL_SHORT),
    ]:
        assert not value & flags
        assert set(short.values()) <= value | flags


def test_the_cli_knows_the_engine_programs_without_importing_them():
    assert set(cli._ENGINE_PROGRAMS) == set(ENGINE_PROGRAMS)


_VALUE_OPTIONS = sorted(container_options.DOCKER_RUN_VALUE)
_FLAG_OPTIONS = sorted(container_options.DOCKER_RUN_FLAGS)
_WORD = st.text(alphabet="abc/:=,-.0", min_size=1, max_size=6)
_ONE_OPTION = st.one_of(
    st.tuples(st.sampled_from(_VALUE_OPTIONS), _WORD).map(lambda o: [o[0], o[1]]),
    st.tuples(st.sampled_from(_VALUE_OPTIONS), _WORD).map(lambda o: [f"{o[0]}={o[1]}"]),
    st.sampled_from(_FLAG_OPTIONS).map(lambda f: [f]),
    st.tuples(st.sampled_from(sorted(container_options.DOCKER_RUN_SHORT)), _WORD).map(
        lambda o: [f"-{o[0]}", o[1]] if container_options.DOCKER_RUN_SHORT[o[0]] in container_options.DOCKER_RUN_VALUE
        else [f"-{o[0]}"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_ONE_OPTION, max_size=8), st.lists(_WORD, max_size=3))
def test_any_mix_of_known_options_leaves_the_image_and_command_found(options, command):
    words = [w for option in options for w in option]
    run = run_of("docker", "run", *words, "the-image:1", *command)
    assert (run.image, run.command, list(run.option_words)) == ("the-image:1", tuple(command), words)


# -- refusals ------------------------------------------------------------------------------


def refusal(*options: str, engine: str = "docker", host: str = "unix:///nonexistent/engine.sock") -> str:
    # Debian's client by its path (another `docker` may come first in PATH here), told of an
    # engine socket: a named volume is looked up with it (the engine's own volume options).
    try:
        with patch.dict(os.environ, {"DOCKER_HOST": host}):
            container_rules.check(run_of(f"/usr/bin/{engine}", "run", *options, "img"))
    except ContainerRefused as exc:
        text = str(exc)
        assert "\n" not in text
        return text
    return ""


@pytest.fixture
def gpu_like_node(tmp_path: Path) -> str:
    """A character node under another name with the GPU driver's major, and a symlink to it."""
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    node = tmp_path / "accel0"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(195, 250))
    (tmp_path / "link").symlink_to(node)
    return str(tmp_path / "link")


@pytest.mark.parametrize("options, says", [
    (["--gpus", "all"], "--gpus all: vaccel gives the container the leased GPUs itself"),
    (["--gpus=1"], "--gpus=1"),
    (["--privileged"], "--privileged gives the container every device"),
    (["--device", "/dev/nvidia0"], "/dev/nvidia0 is a GPU device node"),
    (["--device=/dev/dri/renderD128:/dev/dri/renderD128:rw"], "/dev/dri/renderD128 is a GPU device node"),
    (["--device", "/dev/kfd"], "/dev/kfd is a GPU device node"),
    (["--device", "/dev/dri"], "/dev/dri is a GPU device node"),
    (["--device-cgroup-rule", "c 195:* rwm"], "opens device majors"),
    (["--cap-add", "SYS_ADMIN"], "with SYS_ADMIN"),
    (["--cap-add=cap_sys_admin"], "with CAP_SYS_ADMIN"),
    (["--cap-add", "NET_ADMIN,ALL"], "with ALL"),
    (["-e", "CUDA_VISIBLE_DEVICES=0"], "vaccel sets CUDA_VISIBLE_DEVICES"),
    (["--env=NVIDIA_VISIBLE_DEVICES=all"], "vaccel sets NVIDIA_VISIBLE_DEVICES"),
    (["-eHIP_VISIBLE_DEVICES"], "vaccel sets HIP_VISIBLE_DEVICES"),
    (["-e", "VACCEL_LEASE_ID=l-x"], "vaccel sets VACCEL_LEASE_ID"),
    (["--pid=host"], "--pid=host: a leased container keeps its own pid namespace"),
    (["--pid", "host"], "--pid host"),
    (["--userns=host"], "keeps its own userns namespace"),
    (["-v", "/dev:/dev"], "mounts /dev"),
    (["--mount", "type=bind,src=/dev/dri,dst=/dev/dri"], "mounts /dev/dri"),
    (["-v", "/dev/nvidia1:/dev/nvidia1"], "mounts /dev/nvidia1"),
    (["--label", "org.vaccel.lease=l-1"], "labels org.vaccel.* name the container's lease"),
    (["-l", "org.vaccel.user=alice"], "labels org.vaccel.*"),
])
def test_what_would_defeat_the_lease_is_refused_in_one_line(options, says):
    assert says in refusal(*options)


@pytest.mark.parametrize("options", [
    [], ["--privileged=false"], ["--device", "/dev/fuse"], ["--device", "/dev/null:/dev/x"],
    ["--cap-add", "NET_ADMIN"], ["-e", "FOO=1"], ["-e", "PYTHONPATH"], ["--pid=container:abc"],
    ["--userns=keep-id"], ["-v", "/data:/data:ro"], ["-v", "named:/data"], ["--mount", "type=volume,src=x,dst=/y"],
    ["--label", "team=ml"], ["--user", "1000:1000"], ["--network", "host"], ["-p", "127.0.0.1:8888:8888"],
])
def test_ordinary_options_pass(options):
    assert refusal(*options) == ""


def test_podman_cdi_names_of_gpus_are_refused():
    assert "a GPU named by CDI" in refusal("--device", "nvidia.com/gpu=all", engine="podman")
    assert "a GPU named by CDI" in refusal("--device=amd.com/gpu=0", engine="podman")
    assert refusal("--device", "vendor.example/fpga=0", engine="podman") == ""


def test_the_check_reads_what_the_engine_will_mount(tmp_path: Path):
    (tmp_path / "devices").symlink_to("/dev")
    assert f"mounts {tmp_path}/devices (/dev)" in refusal("-v", f"{tmp_path}/devices:/d")
    assert "mounts /" in refusal("-v", "/:/host")  # binds are recursive: / holds /dev
    assert "mounts /dev" in refusal("--mount", 'type=bind,"source=/dev",target=/d')
    assert "mounts /dev" in refusal("--mount", 'type=bind,"src=/dev",dst=/d,"bind-propagation=rslave"')
    inline = 'type=volume,dst=/d,volume-opt=type=none,"volume-opt=o=bind",volume-opt=device=/dev'
    assert "mounts /dev" in refusal("--mount", inline)
    assert refusal("--mount", "type=volume,dst=/d,volume-opt=type=tmpfs,volume-opt=device=tmpfs") == ""


def test_a_local_volume_that_binds_dev_is_refused(docker_engine):
    docker_engine.docker("volume", "create", "--opt", "type=none", "--opt", "o=bind", "--opt", "device=/dev",
                         "vct-devices", check=True)
    try:
        assert "mounts /dev" in refusal("-v", "vct-devices:/d", host=docker_engine.host)
        assert "mounts /dev" in refusal("--mount", "src=vct-devices,dst=/d", host=docker_engine.host)
        assert refusal("-v", "vct-other:/d", host=docker_engine.host) == ""  # made plain by the engine
    finally:
        docker_engine.docker("volume", "rm", "-f", "vct-devices", "vct-other")


def test_a_gpu_node_under_another_name_is_refused_by_its_major(gpu_like_node: str):
    assert "is a GPU device node" in refusal("--device", gpu_like_node)
    assert "mounts" in refusal("-v", f"{gpu_like_node}:/dev/x")


def test_env_and_label_files_are_read(tmp_path: Path):
    env_file = tmp_path / "env"
    env_file.write_text("# comment\n\nFOO=1\nROCR_VISIBLE_DEVICES=0\n")
    assert "vaccel sets ROCR_VISIBLE_DEVICES" in refusal("--env-file", str(env_file))
    env_file.write_text("FOO=1\n")
    assert refusal("--env-file", str(env_file)) == ""
    labels = tmp_path / "labels"
    labels.write_text("org.vaccel.lease=l-9\n")
    assert "org.vaccel.*" in refusal("--label-file", str(labels))
    assert f"cannot read {tmp_path}/missing" in refusal("--env-file", str(tmp_path / "missing"))


# -- applying a lease ----------------------------------------------------------------------


def lease(backend: str = "cuda", simulated: bool = False, devices: tuple[LeasedDevice, ...] = (),
          env: dict[str, str] | None = None) -> ContainerLease:
    devices = devices or (LeasedDevice(1, "GPU-b", "GPU-b", ("/dev/nvidia1",)),
                          LeasedDevice(3, "GPU-d", "GPU-d", ("/dev/nvidia3",)))
    base_env = {"VACCEL_LEASE_ID": "l-7", "VACCEL_BACKEND": backend, "CUDA_VISIBLE_DEVICES": "GPU-b,GPU-d",
                "VACCEL_DEVICES": "GPU-b,GPU-d", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    return ContainerLease("l-7", "alice", backend, simulated, devices, env or base_env, "/run/vaccel/brokerd.sock")


def pairs(argv: list[str], option: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == option]


def test_a_real_gpu_lease_on_docker_uses_its_gpus_option_and_the_runtime_variable():
    argv, cidfile = apply(run_of("docker", "run", "--rm", "img", "python3", "t.py"), lease(), "/tmp/x/cid")
    assert pairs(argv, "--gpus") == ['"device=GPU-b,GPU-d"']
    assert "--device" not in argv
    env = pairs(argv, "-e")
    assert {"VACCEL_LEASE_ID=l-7", "CUDA_VISIBLE_DEVICES=GPU-b,GPU-d", "NVIDIA_VISIBLE_DEVICES=GPU-b,GPU-d",
            "VACCEL_SOCKET=/run/vaccel/brokerd.sock", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"} <= set(env)
    assert pairs(argv, "--mount") == ["type=bind,src=/run/vaccel,dst=/run/vaccel"]
    assert pairs(argv, "--label") == ["org.vaccel.lease=l-7", "org.vaccel.user=alice", "org.vaccel.devices=GPU-b,GPU-d"]
    assert (pairs(argv, "--cidfile"), cidfile) == (["/tmp/x/cid"], "/tmp/x/cid")
    assert "--init" in argv
    assert argv[:3] == ["docker", "run", "--rm"] and argv[-3:] == ["img", "python3", "t.py"]


def test_a_real_gpu_lease_on_podman_names_each_device_by_cdi():
    argv, _ = apply(run_of("podman", "run", "img"), lease(), "/tmp/x/cid")
    assert pairs(argv, "--device") == ["nvidia.com/gpu=GPU-b", "nvidia.com/gpu=GPU-d"]
    assert "--gpus" not in argv


def test_nodes_where_the_vendor_has_no_engine_option_with_its_shared_node():
    devices = (LeasedDevice(0, "GPU-x", "GPU-x", ("/dev/dri/renderD128",)),)
    for engine in ("docker", "podman"):
        argv, _ = apply(run_of(engine, "run", "img"), lease("rocm", devices=devices, env={"VACCEL_LEASE_ID": "l-7"}),
                        "/c")
        assert pairs(argv, "--device") == ["/dev/kfd", "/dev/dri/renderD128"]
        assert "NVIDIA_VISIBLE_DEVICES=void" in pairs(argv, "-e")  # a vendor base image's `all` overridden


def test_host_ordinals_are_renumbered_inside_and_uuids_kept():
    devices = (LeasedDevice(5, "U5", "3", ("/dev/dri/renderD131",)),
               LeasedDevice(2, "U2", "1", ("/dev/dri/renderD129",)))
    env = container_env(lease("xpu", devices=devices, env={"ZE_AFFINITY_MASK": "3,1", "VACCEL_DEVICES": "3,1"}))
    assert (env["ZE_AFFINITY_MASK"], env["VACCEL_DEVICES"]) == ("1,0", "1,0")
    assert container_env(lease())["CUDA_VISIBLE_DEVICES"] == "GPU-b,GPU-d"


def test_a_simulated_lease_gets_its_device_nodes_and_no_vendor_option():
    for engine in ("docker", "podman"):
        argv, _ = apply(run_of(engine, "run", "img"), lease(simulated=True), "/c")
        assert pairs(argv, "--device") == ["/dev/nvidia1", "/dev/nvidia3"]
        assert "--gpus" not in argv and "NVIDIA_VISIBLE_DEVICES=void" in pairs(argv, "-e")


def test_a_real_device_without_nodes_cannot_be_given_to_a_container():
    devices = (LeasedDevice(4, "U4", "U4", ()),)
    with pytest.raises(ContainerRefused, match="cannot give gpu4 to a docker container"):
        apply(run_of("docker", "run", "img"), lease("xpu", devices=devices), "/c")


def test_the_users_own_cidfile_and_init_choice_are_kept():
    argv, cidfile = apply(run_of("docker", "run", "--cidfile", "/mine", "--init=false", "img"), lease(), "/c")
    assert (pairs(argv, "--cidfile"), cidfile) == (["/mine"], "/mine")
    assert argv.count("--init=false") == 1 and "--init" not in argv


def test_a_socket_folder_with_a_comma_stays_one_mount_field():
    odd = ContainerLease("l-1", "bob", "cuda", True, (), {}, "/tmp/a,b/brokerd.sock")
    argv, _ = apply(run_of("docker", "run", "img"), odd, "/c")
    assert pairs(argv, "--mount") == ['type=bind,"src=/tmp/a,b","dst=/tmp/a,b"']


@pytest.mark.parametrize("command", [["docker-compose", "up"], ["docker", "compose", "up", "-d"],
                                     ["podman-compose", "up"], ["/usr/bin/docker", "-H", "unix:///x", "compose", "run",
                                                                "train"]])
def test_compose_under_vaccel_run_is_refused_in_one_line_saying_what_to_do(command: list[str], tmp_path):
    r = subprocess.run([sys.executable, "-m", "vaccel.cli", "run", "--gpus", "1", "--", *command], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "VACCEL_SOCKET": str(tmp_path / "none.sock")})
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "vaccel run [lease options] -- docker run" in r.stderr, r.stderr


@pytest.mark.parametrize("fields", [["type=bind", "src=/run/vaccel", "dst=/run/vaccel"],
                                    ["type=bind", "src=/tmp/a,b", "dst=/tmp/a,b"],
                                    ["type=bind", 'src=/tmp/say "hi"', "dst=/x"],
                                    ["src=/tmp/line\nbreak", "dst=/tmp/cr\rx"], ["src=", ""]])
def test_the_mount_line_is_what_csv_writes(fields: list[str]):
    """The broker folder's --mount: joined without csv where no field needs quoting (the quick
    path imports no csv), and each field read back by CSV reading as written (a line break
    too: it was left unquoted while the line was written without an end)."""
    out = io.StringIO()
    csv.writer(out).writerow(fields)
    assert _csv(fields) == out.getvalue().removesuffix("\r\n")
    assert next(csv.reader(io.StringIO(_csv(fields), newline=""))) == fields


@pytest.mark.parametrize("path, gpu", [("/dev/nvidia0", True), ("/dev/nvidia-caps/nvidia-cap1", True),
                                       ("/dev/dri", True), ("/dev/dri/renderD128", True), ("/dev/kfd", True),
                                       ("/dev/null", False), ("/dev/../dev/nvidiactl", True), ("/tmp/nvidia0", False),
                                       ("/home/alice/data", False)])
def test_gpu_nodes_are_told_by_name_under_dev_only(path: str, gpu: bool):
    """is_gpu_node reads a name with fnmatch only under /dev, where every glob is (a volume
    elsewhere costs the quick path no re): a glob added elsewhere would be missed there."""
    assert all(glob.startswith("/dev/") for glob in GPU_NODE_GLOBS)
    assert is_gpu_node(path) == gpu
