"""Finding and reading the contract files a job brings: runtime-spec.yaml and
accelerator-config.yaml. The client only reads them; the daemon parses and validates.

Rules, in order:
- an explicit `contract` / `config` path is used as given (relative to `cwd`);
- otherwise accelerator-config.yaml in `cwd` is used when present;
- with no explicit contract, the config's `runtime_contract:` is resolved relative to
  the config file; failing that, runtime-spec.yaml in `cwd` is used when present.
A named file that cannot be read is an error; an absent default file is simply absent.
A file found by these rules is used without being named on the command line, so the
client says which it read (`ContractFiles.said`) and names them in a refusal.
"""

from __future__ import annotations

import os
from typing import NamedTuple

DEFAULT_SPEC = "runtime-spec.yaml"
DEFAULT_CONFIG = "accelerator-config.yaml"
# How a file was found, as `said` puts it.
NAMED, IN_CWD, FROM_CONFIG = "as named", "found in the working directory", "the config's runtime_contract"

# Paths here are strings, cleaned as pathlib would show them: `vaccel run` looks for these
# files on every start, and importing pathlib would cost it ~9 ms.


class ContractFileError(ValueError):
    """A contract file that was asked for cannot be read; the message says which and why."""


class ContractFiles(NamedTuple):
    spec_text: str = ""  # "" when there is no runtime spec
    spec_name: str = ""  # the path as shown in messages
    config_text: str = ""
    config_name: str = ""
    packages: tuple[str, ...] = ()  # dependency names the spec lists
    config_path: str | None = None  # absolute; the accelerator reads its amp_config
    spec_found: str = ""  # how each was found: NAMED, IN_CWD or FROM_CONFIG
    config_found: str = ""
    checked_against: str = ""  # the interpreter the Python side was checked against (vaccel/contract/job_python.py)

    @property
    def empty(self) -> bool:
        return not (self.spec_text or self.config_text)

    def said(self) -> str:
        """One line naming the files read and how each was found; "" when none was."""
        read = [f"{name} ({found})" for name, found in ((self.spec_name, self.spec_found),
                                                       (self.config_name, self.config_found)) if name]
        return f"contract files read: {', '.join(read)}" if read else ""


def load_contract_files(
    contract: str | os.PathLike[str] | None, config: str | os.PathLike[str] | None, cwd: str | os.PathLike[str]
) -> ContractFiles:
    """Read the contract files for a job started in `cwd`. Raises ContractFileError."""
    cwd = os.fspath(cwd)
    config_path = _explicit(config, cwd, "accelerator config") if config else _default(
        _join(cwd, DEFAULT_CONFIG))
    config_text = _read(config_path, "accelerator config") if config_path else ""
    if contract:
        spec_path: str | None = _explicit(contract, cwd, "runtime contract")
        spec_found = NAMED
    else:
        spec_path = _from_config(config_text, config_path)
        spec_found = FROM_CONFIG
        if spec_path is None:
            spec_path, spec_found = _default(_join(cwd, DEFAULT_SPEC)), IN_CWD
    spec_text = _read(spec_path, "runtime contract") if spec_path else ""
    return ContractFiles(
        spec_text=spec_text,
        spec_name=_shown(spec_path, cwd),
        config_text=config_text,
        config_name=_shown(config_path, cwd),
        packages=dependency_names(spec_text),
        config_path=os.path.realpath(config_path) if config_path else None,
        spec_found=spec_found if spec_path else "",
        config_found=(NAMED if config else IN_CWD) if config_path else "",
    )


def _join(folder: str, path: str) -> str:
    """`folder / path` as pathlib joins and shows it: an absolute `path` wins, and empty
    and "." parts drop out (".." stays: a symlinked folder's parent is not lexical)."""
    joined = os.path.join(folder, os.path.expanduser(path))
    parts = [part for part in joined.split("/") if part not in ("", ".")]
    return ("/" if joined.startswith("/") else "") + "/".join(parts) or "."


def _explicit(path: str | os.PathLike[str], cwd: str, what: str) -> str:
    resolved = _join(cwd, os.fspath(path))
    if not os.path.isfile(resolved):
        reason = "is a directory" if os.path.isdir(resolved) else "does not exist"
        raise ContractFileError(f"{what} {os.fspath(path)}: {reason}")
    return resolved


def _default(path: str) -> str | None:
    return path if os.path.isfile(path) else None


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except OSError as exc:
        raise ContractFileError(f"{what} {path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ContractFileError(f"{what} {path}: not UTF-8 text") from None


def _from_config(config_text: str, config_path: str | None) -> str | None:
    """The config's runtime_contract, resolved against the config's folder."""
    if not config_text or config_path is None:
        return None
    import yaml  # only when there is a file to read: `vaccel run` without one never pays for it

    try:
        doc = yaml.safe_load(config_text)
    except yaml.YAMLError:
        return None  # the daemon reports the syntax error with its line
    target = doc.get("runtime_contract") if isinstance(doc, dict) else None
    if not isinstance(target, str) or not target.strip():
        return None
    path = _join(os.path.dirname(config_path), target.strip())
    if not os.path.isfile(path):
        raise ContractFileError(f"{config_path}: runtime_contract {target} not found "
                                f"(looked for {path})")
    return path


def _shown(path: str | None, cwd: str) -> str:
    """`path` relative to `cwd` when it lies under it (lexically, as pathlib's relative_to)."""
    if path is None:
        return ""
    folder = _join(cwd, "")
    if path == folder:
        return "."
    prefix = folder.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else path


def dependency_names(spec_text: str) -> tuple[str, ...]:
    """The `dependencies[].name` values of a runtime spec, read leniently: a broken file
    yields none here and a precise error from the daemon."""
    if not spec_text:
        return ()
    import yaml

    try:
        doc = yaml.safe_load(spec_text)
    except yaml.YAMLError:
        return ()
    deps = doc.get("dependencies") if isinstance(doc, dict) else None
    if not isinstance(deps, list):
        return ()
    return tuple(str(d["name"]) for d in deps if isinstance(d, dict) and d.get("name"))
