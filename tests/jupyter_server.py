"""A real Jupyter server for tests and benchmarks, driven as JupyterLab drives it: its REST
API (POST/GET/DELETE /api/kernels, POST /api/kernels/ID/restart) with a token, and cells
executed over the kernel's websocket (/api/kernels/ID/channels, the JSON protocol).

    server = JupyterServer(tmp_path, env).start()
    kernel = server.api("POST", "/api/kernels", {"name": "vaccel-1gpu"}).body
    server.execute(kernel["id"], "print(1)").stdout        # "1\\n"
    server.stop()

The server runs this interpreter's jupyter_server on a free loopback port, as root when
the tests are root (--allow-root), with the kernelspecs of env's JUPYTER_DATA_DIR. Each
call is bounded in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Reply:
    status: int
    body: Any


@dataclass
class Cell:
    """What one execution produced: streams, the error (if any), the reply's status."""

    status: str = ""
    stdout: str = ""
    stderr: str = ""
    error: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterServer:
    def __init__(self, workdir: Path, env: dict[str, str], python: str = sys.executable) -> None:
        self.workdir = workdir
        self.env = env
        self.python = python
        self.token = secrets.token_hex(16)
        self.port = 0
        self.log = workdir / "jupyter-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> JupyterServer:
        root = self.workdir / "notebooks"
        root.mkdir(exist_ok=True)
        self.port = free_port()
        command = [self.python, "-m", "jupyter_server", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
                   "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                   "--ServerApp.open_browser=False", f"--ServerApp.root_dir={root}"]
        if os.geteuid() == 0:
            command.append("--allow-root")
        env = {**self.env, "JUPYTER_CONFIG_DIR": str(self.workdir / "jupyter-config")}  # no one's own config
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter_server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if self.api("GET", "/api/status").status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"jupyter_server did not answer in {timeout}s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)  # twice: the first only asks "shut down?" on a terminal
        time.sleep(0.2)
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    # -- the REST API --------------------------------------------------------------------

    def api(self, method: str, path: str, body: Any = None, timeout: float = 60) -> Reply:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Authorization": f"token {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
                return Reply(response.status, json.loads(raw) if raw else None)
        except urllib.error.HTTPError as err:
            raw = err.read()
            return Reply(err.code, json.loads(raw) if raw else None)

    def kernel(self, kernel_id: str) -> dict[str, Any] | None:
        """The kernel's model as GET /api/kernels lists it, None when it is not listed."""
        return next((k for k in self.api("GET", "/api/kernels").body if k["id"] == kernel_id), None)

    # -- a cell, over the websocket ------------------------------------------------------

    def execute(self, kernel_id: str, code: str, timeout: float = 60, until: str = "") -> Cell:
        """Run `code` in the kernel; return once it is done, or once a stream says `until`."""
        return asyncio.run(asyncio.wait_for(self._execute(kernel_id, code, until), timeout))

    async def _execute(self, kernel_id: str, code: str, until: str) -> Cell:
        import aiohttp

        session_id = uuid.uuid4().hex
        msg_id = uuid.uuid4().hex
        request = {
            "header": {"msg_id": msg_id, "username": "test", "session": session_id, "msg_type": "execute_request",
                       "version": "5.3", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True},
        }
        cell = Cell()
        url = f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels?session_id={session_id}"
        async with aiohttp.ClientSession() as client, client.ws_connect(
                url, headers={"Authorization": f"token {self.token}"}, max_msg_size=0) as ws:
            await ws.send_str(json.dumps(request))
            idle = False
            async for frame in ws:
                if frame.type != aiohttp.WSMsgType.TEXT:
                    break
                msg = json.loads(frame.data)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                cell.messages.append(msg)
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    setattr(cell, content["name"], getattr(cell, content["name"]) + content["text"])
                elif kind == "error":
                    cell.error = content
                elif kind == "execute_reply":
                    cell.status = content["status"]
                elif kind == "status" and content["execution_state"] == "idle":
                    idle = True
                if (idle and cell.status) or (until and until in cell.stdout + cell.stderr):
                    break
        return cell
