"""What the broker learns of a container from its engine, and the engine's failure: apart from
the engine client (engine.py), so that what only reads them does not import aiohttp."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


class EngineError(Exception):
    """The engine could not be asked, or answered with an error; the message says which."""


@dataclass(frozen=True)
class ContainerInfo:
    """One container as its engine describes it."""

    engine: str  # "docker" | "podman"
    id: str  # the full id
    name: str  # without Docker's leading "/"
    image: str  # as the user named it (Config.Image), not the digest
    pid: int  # State.Pid: the container's init, as a host pid; 0 when it is not running
    running: bool
    labels: Mapping[str, str] = field(default_factory=dict)
    status: str = ""  # State.Status: "created" until it starts, then "running", "exited", ...
    image_id: str = ""  # the image's own id (sha256:...): its labels say which of the container's it gave
    # What it was given of the host's devices: the host paths of its --device nodes and bind
    # mounts, and the ids its device requests name (`--gpus device=...`; "*" for all or a count).
    device_paths: tuple[str, ...] = ()
    device_ids: tuple[str, ...] = ()
