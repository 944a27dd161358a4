"""What `vaccel run` says on stderr when it has its lease (each line after "vaccel: "):
which devices, and the broker's warnings. Shared so that the full runner
(vaccel/run/runner.py) and the broker's ready-made grant (brokerd/edge/views.py, for
vaccel/run/quick_run.py) say it in the same words.
"""

from __future__ import annotations

from vaccel_common.units import format_mib


def grant_lines(lease_id: str, devices: list[tuple[str, str]], simulated: bool, warnings: list[str],
                source: str = "", share_mib: int = 0) -> list[str]:
    """`devices`: (label, name) of each, the label as `vaccel status` shows it (gpu1, gpu1.0);
    `source` follows the id (" (joined: ...)"); `share_mib`: a memory share of its device."""
    names = ", ".join(f"{label} {name}" for label, name in devices)
    if share_mib:
        names = f"a {format_mib(share_mib)} share of {names}"
    return [f"lease {lease_id}{source}: {names}" + (" (simulated)" if simulated else ""),
            *(f"warning: {warning}" for warning in warnings)]
