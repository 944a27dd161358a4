"""The Python a job runs, and its facts: what a contract's Python side (torch version and
build, arch list, dependencies) is checked against for `vaccel run -- CMD` and
`vaccel check --python PATH`.

The `vaccel` command's own interpreter is often not the job's: a lab installs vaccel in a
venv of its own (without torch), and each student runs their own venv's python. So the
facts come from the interpreter CMD runs (which_python), asked by running it with a small
probe: vaccel.accelerator.introspect's own source (it imports only the standard library)
and a few lines that print the facts as JSON. The probe imports torch (1-2 s), so its
answer is cached per interpreter, as long as the interpreter and its site directories are
unchanged (a pip install or uninstall changes a site directory's mtime).

`with lease()` inside a script is the job itself: it keeps gathering in-process
(vaccel.contract.facts).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from vaccel.accelerator import introspect
from vaccel_common.v1 import broker_pb2

# python, python3, python3.11, pypy3, python3.12d: the names an interpreter goes by.
_PYTHON_NAME = re.compile(r"(python|pypy)(\d+(\.\d+)?)?[a-z]?")
# Commands that run a container: the job's Python is the image's, not one on this host.
_CONTAINER_ENGINES = {"docker", "podman", "docker-compose", "nerdctl"}
PROBE_TIMEOUT_S = 300.0  # torch's import on a loaded machine; only turns a hang into an error
_MARK = "vaccel-probe: "
_PROBE_MAIN = '''
import json as _json, platform as _platform, sys as _sys
def _facts(names):
    build = inspect_torch_build()
    packages = {}
    for name in names:
        if name.lower() in ("pytorch", "torch") and build is not None:
            packages[name] = build.version
            continue
        try:
            import importlib.metadata as _md
            packages[name] = _md.version("torch" if name.lower() in ("pytorch", "torch") else name)
        except Exception:
            pass
    return {"python_version": _platform.python_version(), "executable": _sys.executable,
            "build": None if build is None else {k: getattr(build, k) for k in build.__dataclass_fields__},
            "packages": packages, "sys_path": [p for p in _sys.path if p]}
print("MARK" + _json.dumps(_facts(_json.loads(_sys.argv[1]))), flush=True)
'''.replace("MARK", _MARK)


class ProbeFailed(Exception):
    """The interpreter could not be asked (it does not run, or the probe failed)."""


class JobPython(NamedTuple):
    """The job's interpreter and what it said about itself."""

    path: str
    facts: broker_pb2.ClientFacts

    def said(self) -> str:
        """`contract checked against /home/zhang/.venv/bin/python (torch 2.4.1+cu121)`"""
        torch = f"torch {self.facts.torch_version}" if self.facts.torch_version else "torch not installed"
        return f"contract checked against {self.path} ({torch})"


def which_python(command: Sequence[str], env: Mapping[str, str] | None = None) -> str | None:
    """The interpreter `command` runs: the command itself when it is one (`python -m x`
    included), the interpreter of its shebang (a script; torchrun, accelerate and the like
    are scripts whose shebang names their venv's python), else the first `python3` on PATH.
    None for a container engine's command (the image has its own) or when no python3 is on
    PATH. The path is kept as found, not resolved: a venv's python is a link whose
    target is the system's, with other site-packages."""
    env = os.environ if env is None else env
    search = env.get("PATH", os.defpath)
    argv = _past_env(list(command))
    if argv:
        if os.path.basename(argv[0]) in _CONTAINER_ENGINES:
            return None
        found = _found(argv[0], search)
        if found and _PYTHON_NAME.fullmatch(os.path.basename(found)):
            return found
        shebang = _shebang(found) if found else None
        if shebang:
            interpreter = _past_env(shebang)
            if interpreter:
                named = _found(interpreter[0], search)
                if named and _PYTHON_NAME.fullmatch(os.path.basename(named)):
                    return named
    return shutil.which("python3", path=search)


def _past_env(argv: list[str]) -> list[str]:
    """`env [-S] [-u NAME] [NAME=VALUE...] CMD ...` -> `CMD ...` (other argv unchanged)."""
    if not argv or os.path.basename(argv[0]) != "env":
        return argv
    rest = argv[1:]
    while rest:
        if rest[0] in ("-S", "--split-string") and len(rest) > 1:
            rest = shlex.split(rest[1]) + rest[2:]
        elif rest[0] in ("-u", "--unset") and len(rest) > 1:
            rest = rest[2:]
        elif rest[0].startswith("-") or "=" in rest[0]:
            rest = rest[1:]
        else:
            break
    return rest


def _found(name: str, search: str) -> str | None:
    if os.sep in name:
        return name if os.path.isfile(name) else None
    found = shutil.which(name, path=search)
    return os.path.abspath(found) if found else None


def _shebang(path: str) -> list[str] | None:
    """A script's `#!` line as argv (the kernel passes one argument after the interpreter;
    `env -S` splits the rest, which _past_env does)."""
    try:
        with open(path, "rb") as script:
            first = script.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").strip().split(None, 1)
    return words or None


def job_python(command: Sequence[str], packages: Iterable[str] = (),
               env: Mapping[str, str] | None = None) -> JobPython | None:
    """The facts of the interpreter `command` runs (which_python); None when it has none
    on this host. Raises ProbeFailed."""
    path = which_python(command, env)
    return None if path is None else python_at(path, packages, env)


def python_at(path: str, packages: Iterable[str] = (), env: Mapping[str, str] | None = None) -> JobPython:
    """The facts of the interpreter at `path`. Raises ProbeFailed."""
    env = dict(os.environ if env is None else env)
    names = sorted(dict.fromkeys(packages))
    path = os.path.abspath(path)
    # Asked in a process of its own even when it is this very interpreter: the answer is
    # cached, where gathering here would import torch (1-3 s) at every run.
    answer = _cached(path, names, env)
    if answer is None:
        answer = _probe(path, names, env)
        _store(path, names, env, answer)
    return JobPython(path, _as_facts(answer, env))


def _probe(path: str, names: list[str], env: dict[str, str]) -> dict:
    if not os.access(path, os.X_OK):
        raise ProbeFailed(f"{path} is not an executable file")
    source = Path(introspect.__file__).read_text() + _PROBE_MAIN
    try:
        done = subprocess.run([path, "-c", source, json.dumps(names)], env=env, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProbeFailed(f"{path} could not be run: {exc}") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if done.returncode != 0 or not lines:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ProbeFailed(f"{path} could not tell its packages: {said}")
    answer = json.loads(lines[-1][len(_MARK):])
    # What makes the answer stale: the directories its packages come from changing.
    answer["site"] = {d: _mtime(d) for d in answer.pop("sys_path", [])
                      if isinstance(d, str) and os.path.isdir(d)}
    return answer


def _as_facts(answer: dict, env: Mapping[str, str]) -> broker_pb2.ClientFacts:
    from vaccel.contract.facts import FAKE_ARCHS_ENV, FAKE_BACKEND_ENV

    build = introspect.TorchBuild(**{k: tuple(v) if isinstance(v, list) else v for k, v in answer["build"].items()}) \
        if answer.get("build") else None
    fake = env.get(FAKE_ARCHS_ENV, "")
    if fake:  # the test hook, as vaccel.contract.facts applies it
        build = introspect.with_fake_archs(build, [a.strip() for a in fake.split(",") if a.strip()],
                                           env.get(FAKE_BACKEND_ENV, ""))
    facts = broker_pb2.ClientFacts(python_version=answer["python_version"], python_executable=answer["path"])
    if build is not None:
        facts.torch_version, facts.torch_backend = build.version, build.backend
        facts.torch_runtime_version = build.runtime_version
        facts.kernel_archs.extend(build.kernel_archs)
        facts.ptx_archs.extend(build.ptx_archs)
        facts.distributed_available = build.distributed_available
        facts.distributed_backends.extend(build.distributed_backends)
    facts.packages.update(answer["packages"])
    return facts


# -- the cache ------------------------------------------------------------------------------


def _cache_file(path: str, names: list[str], env: Mapping[str, str]) -> Path:
    base = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or "/nonexistent") / ".cache")
    key = json.dumps([path, _mtime(path), names, env.get("PYTHONPATH", ""), env.get("VIRTUAL_ENV", "")])
    return base / "vaccel" / "job-python" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _cached(path: str, names: list[str], env: Mapping[str, str]) -> dict | None:
    try:
        answer = json.loads(_cache_file(path, names, env).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(answer, dict) or answer.get("path") != path:
        return None
    if any(_mtime(d) != mtime for d, mtime in answer.get("site", {}).items()):
        return None  # something was installed or removed since
    return answer


def _store(path: str, names: list[str], env: Mapping[str, str], answer: dict) -> None:
    answer["path"] = path
    target = _cache_file(path, names, env)
    try:  # a cache that cannot be written only costs the next run the probe again
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(json.dumps(answer))
        temp.replace(target)
    except OSError:
        pass


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def facts_for_run(command: Sequence[str], packages: Iterable[str]) -> tuple[broker_pb2.ClientFacts, str]:
    """What `vaccel run -- CMD` sends with a contract: the facts of CMD's interpreter, and
    the line that names it. Without one on this host (a container's command, no python3
    on PATH) no facts: the broker says the Python side was not checked. Raises
    ContractFileError when the interpreter cannot be asked."""
    from vaccel.contract.files import ContractFileError

    try:
        found = job_python(command, packages)
    except ProbeFailed as exc:
        raise ContractFileError(f"the contract's Python side cannot be checked: {exc}") from None
    if found is None:
        return broker_pb2.ClientFacts(), ("contract's Python side not checked: the command runs no Python on this "
                                          "host (a container's command, or no python3 on PATH)")
    return found.facts, found.said()
