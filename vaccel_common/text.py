"""Text that came from a client or from /proc, made safe to show on a terminal or in a
log line: every character that is not printable (control bytes, escape sequences, line
breaks, bidi overrides) is written as a visible escape, so it can neither drive another
user's terminal nor start a forged log line, and an admin still sees what was sent.

The daemon keeps and sends such text exactly as it came (`--json` output shows it as
it is); it is escaped where it is shown: the daemon's log lines (brokerd/base/journal.py) and
the CLI's text output (vaccel/cli/full.py).
"""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with each unprintable character as `\\xNN`, `\\uNNNN` or `\\UNNNNNNNN`."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    code = ord(c)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def argv_text(text: str) -> str:
    """A command-line string as UTF-8 text. Python keeps argv bytes that are not UTF-8 as
    lone surrogates, which no message can carry; each such byte becomes a visible `\\xNN`
    (a reason, a lease id), never a crash. A command to run keeps its bytes: only the copy
    that names it to others goes through here."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
