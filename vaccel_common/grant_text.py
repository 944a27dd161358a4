"""What `vaccel run` says on stderr when it has its lease (each line after "vaccel: "):
which devices, and the broker's warnings. Shared so that the full runner
(vaccel/runner.py) and the broker's ready-made grant (brokerd/edge/views.py, for
vaccel/quick_run.py) say it in the same words.
"""

from __future__ import annotations


def grant_lines(lease_id: str, devices: list[tuple[int, str]], simulated: bool, warnings: list[str],
                source: str = "") -> list[str]:
    """`devices`: (index, name) of each; `source` follows the id (" (joined: ...)")."""
    names = ", ".join(f"gpu{index} {name}" for index, name in devices)
    return [f"lease {lease_id}{source}: {names}" + (" (simulated)" if simulated else ""),
            *(f"warning: {warning}" for warning in warnings)]
