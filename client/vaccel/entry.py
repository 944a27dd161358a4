"""The `vaccel` command's entry point: `vaccel status` answered ready-made, a plain
`vaccel run` by vaccel/run/quick_run.py, everything else by the full CLI (vaccel/cli/full.py).

`python -c pass` takes ~10 ms on a 2-core machine; importing argparse, protobuf and the
renderer took a `vaccel status` to ~40 ms. Here it costs what the interpreter costs plus
one connection: the broker renders the text (or the JSON) for this caller with the CLI's
own code (a view on the identity socket: vaccel_common/side_call.py), and this module
prints it. So every import here is one the answer cannot do without:
  - vaccel_common.paths: where the broker is (the one rule every client follows);
  - vaccel.session.identity_calls, vaccel_common.side_call: one call on the identity socket, the
    view's clocks;
  - _socket: the socket itself (`socket` would bring enum, ~5 ms, for nothing used here).
Not even typing: annotations here are the builtins'.

Only the forms this module reads exactly are answered here: `status` and `status --json`,
with `--socket PATH` or `--socket=PATH` before or after the command. Anything else (help,
an abbreviated option, a typo), and anything unusual on the way (no broker, an older
broker without views, a refusal, a reply that does not parse, a character the terminal's
encoding cannot print), goes to the full CLI, which asks again and says what it says.
The status is read-only, so asking twice changes nothing.
"""

import os
import sys

_VIEWS = {False: "StatusText", True: "StatusJson"}


def main() -> None:
    """Run the command and end the process."""
    words = sys.argv[1:]
    try:
        asked = status_asked(words)
        if asked is not None:
            text = ready_made(*asked)
            if text is not None:
                os._exit(_print(text))
        elif "run" in words:
            from vaccel.run import quick_run

            code = quick_run.run(words)
            if code is not None:
                os._exit(_flushed(code))
    except KeyboardInterrupt:  # Ctrl-C before anything was asked or granted: as the full CLI exits
        os._exit(130)
    from vaccel.cli.full import main as full_cli

    full_cli()  # ends the process


def status_asked(words: list[str]) -> tuple[str | None, bool] | None:
    """(--socket, --json) of a `vaccel status` this module answers, None for any other command line."""
    socket_path: str | None = None
    command_seen = as_json = False
    rest = iter(words)
    for word in rest:
        if word == "--socket":
            socket_path = next(rest, None)
            if socket_path is None or socket_path.startswith("-"):
                return None  # argparse's error (or its reading of the value) is the full CLI's
        elif word.startswith("--socket="):
            socket_path = word[len("--socket="):]
        elif word == "status" and not command_seen:
            command_seen = True
        elif word == "--json" and command_seen and not as_json:
            as_json = True
        else:
            return None
    return (socket_path, as_json) if command_seen else None


def ready_made(socket_arg: str | None, as_json: bool) -> str | None:
    """The broker's rendering of this caller's status, or None for the full CLI to ask."""
    from vaccel.session.identity_calls import ask, folder_is_safe
    from vaccel_common.paths import client_socket, identity_socket

    path = client_socket(socket_arg)
    if not folder_is_safe(path):
        return None
    try:
        answer = ask(identity_socket(path), _VIEWS[as_json], b"")  # the request: an empty StatusRequest
        from vaccel_common.side_call import local_text

        return local_text(answer[1]) if answer is not None and answer[0] == 0 else None
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def _print(text: str) -> int:
    """Write the answer as the full CLI's print() would; the exit status."""
    try:
        sys.stdout.write(text + "\n")
    except UnicodeEncodeError:  # nothing written yet: let the full CLI fail as it fails
        from vaccel.cli.full import main as full_cli

        full_cli()
    return _flushed(0)


def _flushed(code: int) -> int:
    """`code`, once stdout and stderr are out (vaccel/cli/full.py _exit_now's rules: a reader
    that left is fine, a failed write is not)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `vaccel status | head`
        pass
    except (OSError, ValueError):
        code = code or 1
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    return code


if __name__ == "__main__":
    main()
