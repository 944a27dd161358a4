"""How a lease session's outcome reaches a person: the `vaccel` command's exit statuses,
the one-line error that carries one, and the queue lines printed while a request waits.

Here, below the command line, because the runner (vaccel/run) and Slurm's delegate
submission (vaccel/slurm) end a command with these statuses too; vaccel/cli/common.py
gives them to the commands.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE: the broker cannot be reached
EXIT_TEMPFAIL = 75  # sysexits EX_TEMPFAIL: busy with --no-wait, --wait ran out, max_waiting reached
# `vaccel run`: the lease reached its time limit and the command was stopped; timeout(1)'s
# status, so a script tells "ran out of time" from a crash (Slurm's TIMEOUT) as it would there.
EXIT_TIME_LIMIT = 124


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.code = code


def queue_printer(quiet: bool) -> Callable[[str], None]:
    """`vaccel run` and `vaccel reserve` print each queue message once: the broker repeats
    it while nothing changes."""
    last = [""]

    def on_queue(message: str) -> None:
        if message != last[0] and not quiet:
            last[0] = message
            print(f"vaccel: {message}", file=sys.stderr, flush=True)

    return on_queue
