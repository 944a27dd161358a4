"""A client of a container engine's HTTP API over its Unix socket: Docker's Engine API, and
podman's Docker-compatible one (`podman system service`). Only what the broker needs: inspect
a container, stop it with a grace, kill it. Every call is bounded by a timeout and fails
with EngineError, never hangs the daemon's loop.

aiohttp runs on the daemon's own loop (it is a dependency already, for the dashboard); it is
imported with this module, which the daemon imports only when `[containers]` names an engine.
Unversioned paths: both engines serve them at their own current API version.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import aiohttp

from brokerd.addons.containers.info import ContainerInfo, EngineError

__all__ = ["DEFAULT_TIMEOUT_S", "ContainerInfo", "EngineClient", "EngineError"]

DEFAULT_TIMEOUT_S = 5.0


class EngineClient:
    """One engine's API at `socket` (a path, or unix:///path)."""

    def __init__(self, engine: str, socket: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.engine = engine
        self.socket = socket.removeprefix("unix://")
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Made on first use, inside the running loop that will use it.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self.socket))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, timeout_s: float, ok: tuple[int, ...]) -> tuple[int, Any]:
        """(status, decoded JSON body or None); EngineError for any status outside `ok`."""
        url = f"http://{self.engine}{path}"  # the host part is ignored on a Unix socket
        try:
            async with asyncio.timeout(timeout_s):
                async with self._client().request(method, url) as reply:
                    body = await reply.read()
                    status = reply.status
        except TimeoutError:
            raise EngineError(f"{self.engine} at {self.socket}: no answer to {method} {path} "
                              f"within {timeout_s:g}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineError(f"{self.engine} at {self.socket}: {method} {path}: {exc}") from None
        if status not in ok:
            message = body.decode(errors="replace").strip()[:200]
            raise EngineError(f"{self.engine} at {self.socket}: {method} {path}: HTTP {status} {message}")
        if not body or status == 204:
            return status, None
        try:
            return status, json.loads(body)
        except ValueError:
            raise EngineError(f"{self.engine} at {self.socket}: {method} {path}: not JSON") from None

    async def inspect(self, container: str) -> ContainerInfo | None:
        """The container (by id, id prefix or name), None when the engine has no such container."""
        status, doc = await self._call("GET", f"/containers/{_ref(container)}/json", self.timeout_s, (200, 404))
        if status == 404:
            return None
        try:
            state, config, host = doc["State"], doc.get("Config") or {}, doc.get("HostConfig") or {}
            return ContainerInfo(
                engine=self.engine, id=str(doc["Id"]), name=str(doc.get("Name", "")).lstrip("/"),
                image=str(config.get("Image") or doc.get("ImageName") or doc.get("Image") or ""),
                pid=int(state.get("Pid") or 0), running=bool(state.get("Running")),
                labels={str(k): str(v) for k, v in (config.get("Labels") or {}).items()},
                status=str(state.get("Status") or ""), image_id=str(doc.get("Image") or ""),
                device_paths=_device_paths(doc, host), device_ids=_device_ids(host))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EngineError(f"{self.engine} at {self.socket}: unexpected inspect reply ({exc!r})") from None

    async def labelled(self, label: str) -> list[str]:
        """The ids of the containers that carry `label` ("KEY=VALUE"), whatever their state."""
        filters = quote(json.dumps({"label": [label]}), safe="")
        _, doc = await self._call("GET", f"/containers/json?all=1&filters={filters}", self.timeout_s, (200,))
        try:
            return [str(item["Id"]) for item in doc or ()]
        except (KeyError, TypeError) as exc:
            raise EngineError(f"{self.engine} at {self.socket}: unexpected list reply ({exc!r})") from None

    async def running(self) -> list[str]:
        """The ids of the containers running now."""
        _, doc = await self._call("GET", "/containers/json", self.timeout_s, (200,))
        try:
            return [str(item["Id"]) for item in doc or ()]
        except (KeyError, TypeError) as exc:
            raise EngineError(f"{self.engine} at {self.socket}: unexpected list reply ({exc!r})") from None

    async def image_labels(self, image: str) -> dict[str, str]:
        """The labels an image carries (those its containers inherit); {} for an unknown image."""
        if not image:
            return {}
        status, doc = await self._call("GET", f"/images/{_ref(image)}/json", self.timeout_s, (200, 404))
        if status == 404 or not isinstance(doc, dict):
            return {}
        labels = (doc.get("Config") or {}).get("Labels") or {}
        return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}

    async def events(self, actions: tuple[str, ...]) -> AsyncIterator[tuple[str, str]]:
        """(action, container id) as the engine reports `actions` of containers ("start", ...),
        from its event stream, which stays open until the engine goes (then EngineError). The
        first item is ("", "") once the stream is open: what happens from then on is reported."""
        filters = quote(json.dumps({"type": ["container"], "event": list(actions)}), safe="")
        url = f"http://{self.engine}/events?filters={filters}"
        # No total timeout: the stream is meant to stay open; connecting is bounded.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_connect=self.timeout_s,
                                        sock_read=None)
        try:
            async with self._client().get(url, timeout=timeout) as reply:
                if reply.status != 200:
                    raise EngineError(f"{self.engine} at {self.socket}: GET /events: HTTP {reply.status}")
                yield "", ""
                async for line in reply.content:
                    event = _event(line)
                    if event is not None and event[0] in actions:
                        yield event
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise EngineError(f"{self.engine} at {self.socket}: GET /events: {exc or type(exc).__name__}") from None
        raise EngineError(f"{self.engine} at {self.socket}: its event stream ended")

    async def stop(self, container: str, grace_s: float) -> bool:
        """Stop the container: its stop signal (SIGTERM unless the image chose another) to its
        init, SIGKILL after `grace_s`, done by the engine. Waits until it has stopped (the
        grace plus the usual timeout). False when it was not running or does not exist."""
        grace = max(0, round(grace_s))
        status, _ = await self._call("POST", f"/containers/{_ref(container)}/stop?t={grace}",
                                     grace + self.timeout_s, (204, 304, 404))
        return status == 204

    async def kill(self, container: str, signal: str = "SIGKILL") -> bool:
        """Send a signal to the container's init; False when it was not running or does not exist."""
        status, _ = await self._call("POST", f"/containers/{_ref(container)}/kill?signal={quote(signal)}",
                                     self.timeout_s, (204, 404, 409))
        return status == 204


def _event(line: bytes) -> tuple[str, str] | None:
    """(action, container id) of one event line; None for anything else. Docker writes
    `Action` and `Actor.ID` (and the older `status`, `id`); podman's compatible API the same."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("Type", "container") != "container":
        return None
    action = str(doc.get("Action") or doc.get("status") or "")
    actor = doc.get("Actor") if isinstance(doc.get("Actor"), dict) else {}
    container = str(actor.get("ID") or doc.get("id") or "")
    return (action, container) if action and container else None


def _device_paths(doc: dict[str, Any], host: dict[str, Any]) -> tuple[str, ...]:
    """The host paths of the container's --device nodes and of its bind mounts (a node can be
    bind-mounted too); which of them are device nodes the caller finds out."""
    paths = [str(d.get("PathOnHost") or "") for d in host.get("Devices") or () if isinstance(d, dict)]
    paths += [str(m.get("Source") or "") for m in doc.get("Mounts") or ()
              if isinstance(m, dict) and m.get("Type") == "bind"]
    return tuple(p for p in paths if p)


def _device_ids(host: dict[str, Any]) -> tuple[str, ...]:
    """The devices its requests name (`--gpus device=UUID,...`); "*" for `--gpus all` or a count,
    and for `--privileged` (every node of the host's /dev)."""
    ids: list[str] = ["*"] if host.get("Privileged") else []
    for request in host.get("DeviceRequests") or ():
        if not isinstance(request, dict):
            continue
        named = [str(i) for i in request.get("DeviceIDs") or ()]
        ids += named or (["*"] if request.get("Count") else [])
    return tuple(ids)


def _ref(container: str) -> str:
    """A container id or name as one path segment: nothing a caller passes may reach another path."""
    if not container or container in (".", ".."):
        raise EngineError(f"not a container id or name: {container!r}")
    return quote(container, safe="")
