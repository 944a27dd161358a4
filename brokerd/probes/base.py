"""The probe interface: one small class per vendor, each answering "what is here, and why not".

A probe's `probe()` is blocking (management-library calls) and must never raise:
whatever goes wrong becomes the verdict's reason. The daemon runs it off the event loop.
"""

from __future__ import annotations

from typing import Protocol

from brokerd.devices import ProbeResult, ProbeVerdict


class Probe(Protocol):
    vendor: str

    def probe(self) -> ProbeResult:
        """Return the devices found, or an unavailable verdict saying why none were."""
        ...


def unavailable(vendor: str, reason: str) -> ProbeResult:
    return ProbeResult(verdict=ProbeVerdict(vendor=vendor, available=False, reason=reason))
