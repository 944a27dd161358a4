"""A real headless Chromium (Debian's `chromium`), driven over the DevTools protocol: open a
page, read what it shows, take a screenshot. For the dashboard's test
(tests/test_dashboard.py) and the demo's README screenshot (scripts/demo.py --web).

The protocol's websocket is spoken with aiohttp's client (the daemon depends on aiohttp
already), on a loop of this object's own, behind plain blocking methods.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp


class BrowserError(RuntimeError):
    pass


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """One headless browser with one page. Use as a context manager."""

    def __init__(self, width: int = 1280, height: int = 800, timeout: float = 20.0) -> None:
        binary = find_chromium()
        if binary is None:
            raise BrowserError("chromium is not installed (scripts/setup.sh installs Debian's chromium)")
        self.width, self.height, self.timeout = width, height, timeout
        self._profile = Path(tempfile.mkdtemp(prefix="vaccel-chromium-"))
        self._proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
             "--no-first-run", "--disable-extensions", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        try:
            self._run(self._connect(self._port()))
        except BaseException:
            self.close()
            raise

    def _port(self) -> int:
        # With port 0 Chromium picks a free one and writes it into the profile.
        active = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrowserError(f"chromium exited with {self._proc.returncode} before it listened")
            if active.exists() and active.read_text().strip():
                return int(active.read_text().split()[0])
            time.sleep(0.05)
        raise BrowserError(f"chromium did not open its DevTools port in {self.timeout}s")

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(asyncio.wait_for(coro, self.timeout))

    async def _connect(self, port: int) -> None:
        self._session = aiohttp.ClientSession()
        for _ in range(100):
            async with self._session.get(f"http://127.0.0.1:{port}/json/list") as reply:
                pages = [t for t in await reply.json(content_type=None) if t.get("type") == "page"]
            if pages:
                break
            await asyncio.sleep(0.05)
        else:
            raise BrowserError("chromium opened no page")
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=64 << 20)
        await self._call("Emulation.setDeviceMetricsOverride",
                         {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})

    async def _call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self._ws is not None
        call_id = next(self._ids)
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params or {}}))
        while True:
            message = await self._ws.receive()
            if message.type != aiohttp.WSMsgType.TEXT:
                raise BrowserError(f"the DevTools connection closed during {method}")
            data = json.loads(message.data)
            if data.get("id") == call_id:  # events (no id) are not wanted here
                if "error" in data:
                    raise BrowserError(f"{method}: {data['error'].get('message')}")
                return data.get("result", {})

    # -- what a test or a script does --------------------------------------------------

    def open(self, url: str) -> None:
        self._run(self._call("Page.navigate", {"url": url}))
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str) -> Any:
        result = self._run(self._call("Runtime.evaluate", {"expression": expression, "returnByValue": True}))
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def wait_for(self, expression: str, timeout: float | None = None, interval: float = 0.05) -> Any:
        """Poll `expression` in the page until it is truthy; its value, or BrowserError."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() >= deadline:
                raise BrowserError(f"not true within {timeout}s: {expression}")
            time.sleep(interval)

    def screenshot(self, path: Path) -> Path:
        data = self._run(self._call("Page.captureScreenshot", {"format": "png"}))["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if self._ws is not None:
                self._run(self._ws.close())
            if self._session is not None:
                self._run(self._session.close())
        except (BrowserError, aiohttp.ClientError, TimeoutError, OSError):
            pass
        finally:
            self._loop.close()
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
