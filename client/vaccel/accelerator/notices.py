"""The accelerator's warnings, shown to a student as one `vaccel:` line each.

They stay real warnings (a program may filter them or turn them into errors, and
`pytest.warns` sees them), but Python's default display adds the file, the line number
and the source line of the call inside vaccel: noise that reads like a crash. Only these
categories are shown differently; every other warning goes to the display it had.
"""

from __future__ import annotations

import warnings


class VaccelWarning(UserWarning):
    """Base of the warnings the accelerator gives about the lease it runs under."""


class SimulatedDevicesWarning(VaccelWarning):
    """The lease holds simulated devices, so the accelerator computes on the CPU."""


class NoLeaseWarning(VaccelWarning):
    """No lease in the environment, so the accelerator computes on the CPU."""


_format_before = warnings.formatwarning


def _format(message: Warning | str, category: type[Warning], filename: str, lineno: int,
            line: str | None = None) -> str:
    if isinstance(category, type) and issubclass(category, VaccelWarning):
        text = str(message)
        return (text if text.startswith("vaccel:") else f"vaccel: {text}") + "\n"
    return _format_before(message, category, filename, lineno, line)


def install() -> None:
    """Format VaccelWarnings as one line; idempotent. Only the formatting is replaced, not
    `showwarning`, so warnings.catch_warnings(record=True) and pytest.warns still see them."""
    global _format_before
    if warnings.formatwarning is not _format:
        _format_before = warnings.formatwarning
        warnings.formatwarning = _format
