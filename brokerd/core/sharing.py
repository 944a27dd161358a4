"""Which devices are leased by memory: `[sharing] devices` (docs/sharing.md) resolved
against the devices the probe found, at every probe and every reload, for the lease
manager (brokerd/leasing/shares.py has the rules of a share).

A name is a device's index as `vaccel status` shows it (gpu3, or gpu0.1 for a MIG
instance), its uuid, or "all". A GPU in MIG mode is named by its index or uuid too: that
shares each of its instances. A name that matches nothing (a typo, a GPU gone) is said
once in the journal, and again only after it matched something meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from brokerd.base.journal import log_event
from brokerd.devices.model import Device

ALL = "all"


def _named(name: str, device: Device) -> bool:
    gpu = f"gpu{device.index}"
    return name in (device.uuid, device.label, device.label.removeprefix("gpu")) or (
        device.mig_index >= 0 and name in (device.parent_uuid, gpu, str(device.index)))


class SharedDevices:
    def __init__(self) -> None:
        self._unmatched_told: set[str] = set()

    def resolve(self, names: Sequence[str], devices: Iterable[Device]) -> frozenset[str]:
        """The uuids of the devices `names` marks shared."""
        devices = list(devices)
        if ALL in names:
            return frozenset(d.uuid for d in devices)
        shared: set[str] = set()
        for name in names:
            matched = {d.uuid for d in devices if _named(name, d)}
            shared |= matched
            if matched:
                self._unmatched_told.discard(name)
            elif name not in self._unmatched_told:
                self._unmatched_told.add(name)
                log_event("sharing", f"[sharing] devices names {name!r}, which is no device here (see `vaccel "
                          "status`): not shared", level=logging.WARNING)
        return frozenset(shared)
