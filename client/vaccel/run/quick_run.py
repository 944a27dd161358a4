"""A plain `vaccel run [-q] [--gpus N] -- CMD` at the interpreter's floor.

The full runner (vaccel/run/runner.py) imports argparse, protobuf, threading, subprocess and
the lease machinery: ~35 ms on a 2-core machine before it asks for anything, more than
Slurm's whole `srun --gres=gpu:1 true`. Most runs need none of it to start: the broker
grants at once, and a short command ends before the first heartbeat is due. So this
module asks for the grant ready-made (the RunNow view, vaccel_common/side_call.py: the
lines to say, the variables to set), starts the command as the runner does, and:

- when the command ends within QUICK_S (and before anything else happens that the
  runner would act on), gives the lease back over the identity socket and exits with the
  command's status, saying what the runner says;
- otherwise hands the lease and the running command over to the runner
  (runner.continue_run), which heartbeats, forwards signals, hears the lease's end and
  releases, as if it had started the command itself. The runner's first heartbeat
  comes a heartbeat interval after its start, so QUICK_S (at most half an interval)
  delays nothing it would have learned: the broker's word on the lease arrives with a
  heartbeat either way.

Until the hand-over, signals are handled as the runner handles them (forwarded to the
command, Ctrl-C and Ctrl-Z not twice, job control). The command dies with us
(PR_SET_PDEATHSIG) and the broker frees the lease when our pid ends, as with the runner.

Anything else goes to the full CLI, before anything is asked: another option, a contract
file in the working directory, a container engine's command other than a foreground `run`
(vaccel/run/quick_container.py takes those), a command that is not found, inside a
lease or a Slurm job, a login node in submit mode (vaccel/slurm/submit.py), no answer or a
refusal from the broker (the full CLI asks again and says it), a request that must wait.
Imports: _signal (signal would bring enum, ~5 ms), ctypes (prctl: the runner's too), the
identity socket's call (vaccel/session/identity_calls.py, vaccel_common/side_call.py, as
vaccel/entry.py), the command's lookup (vaccel/run/command_path.py) and its process
(vaccel/run/forked.py).
"""

import _signal
import os
import sys

from vaccel.run.forked import Forked

FORWARDED = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT, _signal.SIGUSR1, _signal.SIGUSR2)
_JOB_CONTROL = (_signal.SIGTSTP, _signal.SIGCONT)
WAITED = frozenset({*FORWARDED, *_JOB_CONTROL, _signal.SIGCHLD})  # vaccel/run/runner.py's _WAITED
_TIMER = _signal.SIGALRM  # the end of the quick path
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent (the terminal's Ctrl-C, Ctrl-Z)
_PR_SET_PDEATHSIG = 1
QUICK_S = 0.2
# As vaccel/cli/full.py and vaccel/contract/files.py name them (tests/test_quick_run.py checks).
ENGINE_PROGRAMS = ("docker", "podman", "podman-remote")
CONTRACT_FILES = ("runtime-spec.yaml", "accelerator-config.yaml")
_ALREADY_ENDED = (5, 9)  # NOT_FOUND, FAILED_PRECONDITION: a release with nothing to give back


def run_asked(words: list[str]) -> tuple[str | None, bool, int, list[str]] | None:
    """(--socket, --quiet, --gpus, command) of a `vaccel run` this module reads, else None."""
    socket_path: str | None = None
    quiet = seen_run = False
    gpus = 1
    rest = iter(words)
    for word in rest:
        if word in ("--socket", "--gpus"):
            value = next(rest, None)
            if value is None or value.startswith("-"):
                return None
            word = f"{word}={value}"
        if word.startswith("--socket="):
            socket_path = word[len("--socket="):]
        elif not seen_run:
            if word != "run":
                return None
            seen_run = True
        elif word.startswith("--gpus="):
            value = word[len("--gpus="):]
            if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 64):
                return None  # the full CLI says what is wrong with it
            gpus = int(value)
        elif word in ("-q", "--quiet"):
            quiet = True
        elif word == "--" or not word.startswith("-"):
            command = list(rest) if word == "--" else [word, *rest]
            return (socket_path, quiet, gpus, command) if command else None
        else:
            return None
    return None


def run(words: list[str]) -> int | None:
    """The command's exit status, or None (nothing asked, or nothing granted) for the full
    CLI. The signals the runner waits for stay blocked either way, as the runner blocks them
    before it asks: one that came meanwhile waits for whichever acts on it."""
    asked = run_asked(words)
    if asked is None:
        return None
    socket_arg, quiet, gpus, command = asked
    from vaccel.session.identity_calls import ask, folder_is_safe
    from vaccel_common.paths import client_socket, identity_socket

    path = client_socket(socket_arg)
    container = None
    if os.path.basename(command[0]) in ENGINE_PROGRAMS:  # a container's run: vaccel/run/quick_container.py
        from vaccel.run import quick_container

        container = quick_container.readable(command)
        if container is None:
            return None
    if not _plain(command, container is not None) or not folder_is_safe(path):
        return None
    from vaccel_common.side_call import acquire_request, release_request, unpacked

    _signal.pthread_sigmask(_signal.SIG_BLOCK, WAITED)
    try:
        answer = ask(identity_socket(path), "RunNow", acquire_request(gpus, " ".join(command), os.urandom(12).hex()))
        fields = unpacked(answer[1]) if answer is not None and answer[0] == 0 else []
    except (OSError, ValueError):  # unreachable, or a command line protobuf would refuse too
        return None
    if len(fields) != 7 or fields[0] != b"granted":
        return None  # it must wait (nothing was queued), or the broker said no: the full CLI asks again
    lease_id, granted = fields[1].decode(errors="replace"), fields[3]
    try:
        lines, env, quick_s = _grant(fields)
    except ValueError:  # not what this client reads: give the lease back, let the full CLI ask
        try:
            ask(identity_socket(path), "Release", release_request(lease_id))
        except OSError:
            pass  # the broker frees it when this process ends
        return None
    if container is not None:
        return quick_container.run_granted(container, fields, env, lines, path, socket_arg, quiet,
                                           quick_container.Quick(_spawn, _ends_quickly, _release))
    for line in lines:
        print(f"vaccel: {line}", file=sys.stderr, flush=True)
    try:
        child = Forked(_spawn(command, env))
    except OSError as exc:
        print(f"vaccel: cannot run {command[0]}: {exc.strerror}", file=sys.stderr, flush=True)
        code = 127 if isinstance(exc, FileNotFoundError) else 126
    else:
        if not _ends_quickly(child, quick_s):
            from vaccel.run.runner import continue_run

            return continue_run(child, granted, socket=socket_arg, quiet=quiet)
        code = child.returncode or 0
        code = 128 - code if code < 0 else code
    _release(path, lease_id, granted, socket_arg, quiet)
    return code


def _grant(fields: list[bytes]) -> tuple[list[str], dict[str, str], float]:
    """(the lines to say, the command's environment, how long the quick path lasts) of a
    RunNow grant; ValueError for a reply this client cannot read."""
    unset = set(fields[5].decode().split("\0"))
    env = {k: v for k, v in os.environ.items() if k not in unset}  # as the runner's child_env
    for item in fields[4].decode().split("\0"):
        name, _, value = item.partition("=")
        env[name] = value
    return fields[2].decode().split("\0"), env, min(QUICK_S, float(fields[6]) / 2)


def _plain(command: list[str], container: bool = False) -> bool:
    """Whether the full runner would just lease and run `command`: not inside a lease or a
    Slurm job, not a login node in submit mode, no contract file here, no container engine
    (unless `container`: a run vaccel/run/quick_container.py takes), a command that is there
    (else the full CLI says so, before anything is leased)."""
    from vaccel.run.command_path import CommandNotFound, find_command

    if os.environ.get("VACCEL_LEASE_ID") or os.environ.get("SLURM_JOB_ID") or _submit_mode_possible():
        return False
    if any(os.path.lexists(name) for name in CONTRACT_FILES) or (
            os.path.basename(command[0]) in ENGINE_PROGRAMS and not container):
        return False
    try:
        find_command(command[0])
    except CommandNotFound:
        return False
    return True


def _submit_mode_possible() -> bool:
    """vaccel/slurm/submit.py settings()'s first look, without parsing: the word "submit" in
    the broker host's config (the full CLI parses it), or a config it cannot read."""
    from vaccel_common.paths import BROKER_CONFIG, BROKER_CONFIG_ENV

    if os.environ.get("VACCEL_SLURM") == "off":
        return False
    try:
        with open(os.environ.get(BROKER_CONFIG_ENV) or BROKER_CONFIG, encoding="utf-8", errors="replace") as file:
            return "submit" in file.read()
    except (FileNotFoundError, PermissionError):
        return False
    except OSError:
        return True


def _spawn(command: list[str], env: dict[str, str]) -> int:
    """Start `command` as the runner's subprocess.Popen does (PATH search in `env`, every
    other file descriptor closed, SIGPIPE and SIGXFSZ back to their defaults) and with its
    _child_setup (die with us, take signals again). Its pid; OSError when it cannot run."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before the fork, as the runner does
    parent = os.getpid()
    max_fd = os.sysconf("SC_OPEN_MAX")
    failed_read, failed_write = os.pipe()  # close-on-exec: it ends with the exec, or says why not
    pid = os.fork()
    if pid == 0:
        try:
            prctl(_PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
            for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):
                _signal.signal(sig, _signal.SIG_DFL)
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, WAITED | {_TIMER})
            os.closerange(3, failed_write)
            os.closerange(failed_write + 1, max_fd)
            os.execvpe(command[0], command, env)
        except OSError as exc:
            os.write(failed_write, b"%d" % (exc.errno or 0))
        finally:
            os._exit(255)
    os.close(failed_write)
    try:
        failure = os.read(failed_read, 32)
    finally:
        os.close(failed_read)
    if failure:
        os.waitpid(pid, 0)
        errno = int(failure)
        raise OSError(errno, os.strerror(errno))  # FileNotFoundError for ENOENT, as Popen raises it
    return pid


def _ends_quickly(child: Forked, quick_s: float) -> bool:
    """Watch the command for `quick_s` as the runner would; True when it ended, False when
    the runner takes over (the timer's signal drained, the waited ones still blocked)."""
    _signal.pthread_sigmask(_signal.SIG_BLOCK, {_TIMER})
    _signal.setitimer(_signal.ITIMER_REAL, quick_s)
    try:
        while child.poll() is None:
            info = _signal.sigwaitinfo(WAITED | {_TIMER})
            signo, code = info.si_signo, info.si_code
            if signo == _TIMER:
                return False
            if signo == _signal.SIGCHLD:
                continue
            # From the terminal (Ctrl-C, Ctrl-Z) it already reached the child: same process group.
            from_terminal = code == _SI_KERNEL and signo in (_signal.SIGINT, _signal.SIGTSTP)
            if signo == _signal.SIGTSTP:
                if not from_terminal:
                    child.send_signal(_signal.SIGTSTP)
                os.kill(os.getpid(), _signal.SIGSTOP)  # stopped as SIGTSTP's default would; on until SIGCONT
            elif signo == _signal.SIGCONT:
                from vaccel.run.process_tree import is_stopped

                if is_stopped(child.pid):
                    child.send_signal(_signal.SIGCONT)
            elif not from_terminal:
                child.send_signal(signo)
        return True
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        if _TIMER in _signal.sigpending():
            _signal.sigtimedwait([_TIMER], 0)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_TIMER})


def _release(path: str, lease_id: str, granted: bytes, socket_arg: str | None, quiet: bool) -> None:
    """Give the lease back and say so as LeaseSession.release and the runner do; when the
    identity socket does not answer, their own release (with its retries) does it."""
    from vaccel.session.identity_calls import ask
    from vaccel_common.paths import identity_socket
    from vaccel_common.side_call import release_request

    try:
        answer = ask(identity_socket(path), "Release", release_request(lease_id))
    except OSError:
        answer = None
    if answer is None:
        from vaccel.session.lease_session import LeaseSession
        from vaccel_common.v1 import broker_pb2 as pb

        with LeaseSession(socket_arg, say=lambda m: print(f"vaccel: {m}", file=sys.stderr, flush=True)) as session:
            session.adopt(pb.AcquireUpdate.FromString(granted).granted, joined=False)
            if session.release() and not quiet:
                print(f"vaccel: lease {lease_id} released", file=sys.stderr, flush=True)
    elif answer[0] == 0:
        if not quiet:
            print(f"vaccel: lease {lease_id} released", file=sys.stderr, flush=True)
    elif answer[0] not in _ALREADY_ENDED:
        print(f"vaccel: could not release lease {lease_id} ({answer[1].decode(errors='replace')}); "
              "the broker reclaims it when this process exits", file=sys.stderr, flush=True)
