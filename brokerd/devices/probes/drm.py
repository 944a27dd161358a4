"""The DRM render node of a GPU, from sysfs.

/sys/bus/pci/devices/<bdf>/drm/ lists the DRM minors the kernel made for that PCI
function: `cardN` (the display side) and `renderDN`, which is what a compute runtime opens
to use the device (through /dev/dri/renderDN). Enforcement (brokerd/addons/enforce/) gates that
node, so a device's node is a probe fact like its bus id.
"""

from __future__ import annotations

import re
from pathlib import Path

_RENDER = re.compile(r"renderD\d+")


def render_nodes(pci_device: Path, dev_root: Path = Path("/dev")) -> tuple[str, ...]:
    """The /dev/dri/renderD* nodes of the PCI device at sysfs path `pci_device`; () when it
    has none or sysfs cannot say (enforcement then fails closed for that device)."""
    try:
        names = sorted(entry.name for entry in (pci_device / "drm").iterdir() if _RENDER.fullmatch(entry.name))
    except OSError:
        return ()
    return tuple(str(dev_root / "dri" / name) for name in names)
