"""`vaccel run -- docker run ...`: recognise a container engine's `run` in the command and
read it exactly, so the lease can be applied to the container rather than to the engine's
client (whose environment never reaches the container).

    run = recognise(["docker", "-H", "unix:///x.sock", "run", "--rm", "-itv", "/a:/b", "img", "sh"])
    run.engine, run.image, run.command     # "docker", "img", ["sh"]

Recognised: `docker run`, `docker container run`, `podman run`, `podman container run`, the
program by name or full path, with the engine's global options before `run`. Every option
is read from the engine's own table (client/vaccel/containers/options.py): `--opt value`,
`--opt=value`, `-ovalue`, short clusters (`-it`, `-itv /a:/b`). An option missing from the
table is refused: guessing whether it takes a value could take the IMAGE for its value.
What is refused for the lease's sake is container_rules.py's; the rewrite, container_argv.py's.
"""

from __future__ import annotations

import os

from vaccel.containers import options as opts
from vaccel.session.lease import LeaseError
from vaccel_common.record import record

# pflag's spellings of true: `--rm=1`, `--privileged=T`.
_TRUE = frozenset({"", "1", "t", "T", "true", "TRUE", "True"})


class ContainerRefused(LeaseError, ValueError):
    """The container command cannot be run under a lease as written; one line says why. A
    LeaseError too: where it is found only once the lease is known (`-d` with `--lease`), the
    CLI says it as any refusal, in one line, exit status 2 (invalid_argument)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "invalid_argument")


@record
class _Syntax:
    value: frozenset[str]  # long options that take a value
    flags: frozenset[str]  # long options that do not
    short: dict[str, str]  # one letter -> its long option


@record
class _Engine:
    name: str
    global_options: _Syntax
    run_options: _Syntax


_DOCKER = _Engine("docker", _Syntax(opts.DOCKER_GLOBAL_VALUE, opts.DOCKER_GLOBAL_FLAGS, opts.DOCKER_GLOBAL_SHORT),
                  _Syntax(opts.DOCKER_RUN_VALUE, opts.DOCKER_RUN_FLAGS, opts.DOCKER_RUN_SHORT))
_PODMAN = _Engine("podman", _Syntax(opts.PODMAN_GLOBAL_VALUE, opts.PODMAN_GLOBAL_FLAGS, opts.PODMAN_GLOBAL_SHORT),
                  _Syntax(opts.PODMAN_RUN_VALUE, opts.PODMAN_RUN_FLAGS, opts.PODMAN_RUN_SHORT))
# The program's file name -> its engine.
ENGINE_PROGRAMS = {"docker": _DOCKER, "podman": _PODMAN, "podman-remote": _PODMAN}


@record
class Option:
    """One option as given: its long name, its value (None for a flag written without one)
    and how the user spelt it (for messages)."""

    name: str
    value: str | None
    spelling: str

    @property
    def on(self) -> bool:
        """For a flag: whether it was turned on (`--rm`, `--rm=true`; not `--rm=false`)."""
        return self.value is None or self.value in _TRUE


@record
class ContainerRun:
    """A container engine's `run` command, read. The words are kept as given, so the command
    can be rebuilt with options added and nothing of the user's changed."""

    engine: str  # "docker" | "podman"
    program: str  # argv[0] as given
    global_words: tuple[str, ...]  # the engine's global options, as given
    subcommand: tuple[str, ...]  # ("run",) or ("container", "run")
    option_words: tuple[str, ...]  # the run options, as given
    double_dash: bool  # a `--` stood between the options and the IMAGE
    image: str
    command: tuple[str, ...]  # what follows the IMAGE
    options: tuple[Option, ...]
    global_options: tuple[Option, ...]

    def values(self, name: str) -> list[str]:
        """Every value given to a run option (`-e A -e B` -> ["A", "B"])."""
        return [o.value for o in self.options if o.name == name and o.value is not None]

    def given(self, name: str) -> bool:
        return any(o.name == name for o in self.options)

    def flag(self, name: str) -> bool:
        """A run flag's final state: the last spelling wins, as in the engine."""
        last = [o for o in self.options if o.name == name]
        return bool(last) and last[-1].on

    def first(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)

    @property
    def detached(self) -> bool:
        return self.flag("--detach")

    @property
    def stdin_attached(self) -> bool:
        """-i, or -a stdin: the engine's client reads the container's stdin, and from it the keys
        that detach from the container (Ctrl-P Ctrl-Q). Without it a foreground run cannot be
        detached from: its client's return is the container's end, and the engine need not be
        asked (bench/container_overhead.py: another start of its client, ~60 ms)."""
        return self.flag("--interactive") or any(value.lower() == "stdin" for value in self.values("--attach"))

    def argv(self, added: list[str]) -> list[str]:
        """The command with `added` after the user's own options (so that where an option is
        single-valued, ours is the one the engine keeps) and before the IMAGE."""
        return [self.program, *self.global_words, *self.subcommand, *self.option_words, *added,
                *(["--"] if self.double_dash else []), self.image, *self.command]


def engine_of(argv: list[str]) -> str:
    """The engine the command's program is ("" for any other program): cheap, no parsing."""
    engine = ENGINE_PROGRAMS.get(os.path.basename(argv[0])) if argv else None
    return engine.name if engine is not None else ""


def recognise(argv: list[str]) -> ContainerRun | None:
    """The command read as a container run, or None when it is none (another program, or
    another subcommand of the engine: `docker ps` runs as it is). Raises ContainerRefused
    when it is a run that cannot be read exactly."""
    engine = ENGINE_PROGRAMS.get(os.path.basename(argv[0])) if argv else None
    if engine is None:
        return None
    global_options, run_at, _ = _read_options(argv, 1, engine.global_options, engine.name)
    if argv[run_at:run_at + 1] == ["run"]:
        subcommand: tuple[str, ...] = ("run",)
    elif argv[run_at:run_at + 2] == ["container", "run"]:
        subcommand = ("container", "run")
    else:
        return None
    start = run_at + len(subcommand)
    options, image_at, double_dash = _read_options(argv, start, engine.run_options, f"{engine.name} run")
    if image_at >= len(argv):
        raise ContainerRefused(f"{engine.name} run names no IMAGE: {engine.name} run [OPTIONS] IMAGE [COMMAND]")
    return ContainerRun(
        engine=engine.name, program=argv[0], global_words=tuple(argv[1:run_at]), subcommand=subcommand,
        option_words=tuple(argv[start:image_at - 1 if double_dash else image_at]), double_dash=double_dash,
        image=argv[image_at], command=tuple(argv[image_at + 1:]), options=tuple(options),
        global_options=tuple(global_options))


def _read_options(argv: list[str], at: int, syntax: _Syntax, what: str) -> tuple[list[Option], int, bool]:
    """Read options from argv[at] up to the first word that is none; returns them, the index
    of that word, and whether a `--` ended them (it is skipped)."""
    found: list[Option] = []
    while at < len(argv):
        word = argv[at]
        if word == "--":
            return found, at + 1, True
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            if name in syntax.flags:
                found.append(Option(name, value if eq else None, word))
            elif name in syntax.value:
                if not eq:
                    value = _next_value(argv, at, word, what)
                    at += 1
                found.append(Option(name, value, word if eq else f"{word} {value}"))
            else:
                raise ContainerRefused(f"{what}: vaccel does not know the option {name} (it must know every option "
                                       "to find the IMAGE): check its spelling; if your engine has it, "
                                       "vaccel/containers/options.py lacks it")
            at += 1
        elif word.startswith("-") and len(word) > 1:
            at = _read_cluster(argv, at, syntax, what, found)
        else:
            break
    return found, at, False


def _read_cluster(argv: list[str], at: int, syntax: _Syntax, what: str, found: list[Option]) -> int:
    """One word of short options (`-it`, `-p8080:80`, `-itv /a:/b`, `-d=false`): flags until
    one takes a value, which is the rest of the word or else the next word."""
    word = argv[at]
    for position in range(1, len(word)):
        letter = word[position]
        name = syntax.short.get(letter)
        if name is None:
            raise ContainerRefused(f"{what}: vaccel does not know the option -{letter} (in {word})")
        rest = word[position + 1:]
        if name in syntax.flags:
            if rest.startswith("="):  # `-d=false`
                found.append(Option(name, rest[1:], word))
                return at + 1
            found.append(Option(name, None, word))
            continue
        if rest:
            found.append(Option(name, rest[1:] if rest.startswith("=") else rest, word))
            return at + 1
        value = _next_value(argv, at, word, what)
        found.append(Option(name, value, f"{word} {value}"))
        return at + 2
    return at + 1


def _next_value(argv: list[str], at: int, word: str, what: str) -> str:
    if at + 1 >= len(argv):
        raise ContainerRefused(f"{what}: {word} needs a value")
    return argv[at + 1]
