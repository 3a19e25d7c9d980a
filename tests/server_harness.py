"""Run the patched mlx-vlm server as a real subprocess, for integration tests.

Why a subprocess: the overlay must be installed before mlx-vlm is imported, and a server
holds global state (model, APC manager), so every test gets a fresh process started exactly
the way an operator starts it: ``python -m server_patch.launch --model DIR --port N``.

Usage (standard library HTTP only)::

    server = PatchedServer(model_dir, env={"APC_LINEAGE": "0"}, log_dir=tmp_path).start()
    try:
        health = server.get_json("/health")
        reply = server.chat([{"role": "user", "content": "Hi"}], max_tokens=4)
    finally:
        server.stop()

or ``with PatchedServer(...) as server:``. Defaults: loopback, APC on, the disk tier off and,
if it is turned on, pointed at a private directory (never ``~/.cache``), Hub access off.
``env`` overrides those; a value of ``None`` removes the variable.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "APC_ENABLED": "1",
    "APC_DISK_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
}


ADMIN_TOKEN = "test-admin-token"


def free_port(host: str = HOST) -> int:
    """A port nothing listens on right now (the kernel picks it; a small race remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerError(RuntimeError):
    """The server did not come up, or answered with an HTTP error."""


class PatchedServer:
    """One ``server_patch.launch`` process serving ``model_dir`` on loopback."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        port: int | None = None,
        env: Mapping[str, str | None] | None = None,
        args: Sequence[str] = (),
        log_dir: Path | str | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.port = port or free_port()
        self.args = list(args)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="apc-server-"))
        self.log_path = self.log_dir / f"server-{self.port}.log"
        self.startup_timeout = startup_timeout
        self.env = self._environment(env or {})
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise ServerError("server not started")
        return self.process.pid

    def _environment(self, overrides: Mapping[str, str | None]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(BASE_ENV)
        env["APC_DISK_PATH"] = str(self.log_dir / "apc-disk")
        # Lineage disk tier, admin token and state never touch the user's real directories.
        env["APC_LINEAGE_DISK_PATH"] = str(self.log_dir / "lineage-disk")
        env["APC_STATE_DIR"] = str(self.log_dir / "state")
        env["APC_ADMIN_TOKEN"] = ADMIN_TOKEN
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        for key, value in overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "server_patch.launch",
            "--model", str(self.model_dir), "--port", str(self.port), *self.args,
        ]

    def start(self) -> "PatchedServer":
        """Start the process and wait until ``/health`` answers 200 (or fail with the log)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(), cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"server exited with {self.process.returncode} before /health answered:\n"
                    + self.log_tail()
                )
            try:
                status, _ = self.request("GET", "/health", timeout=2.0)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise ServerError(f"/health did not answer within {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code. Safe to call twice."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)
        return self.process.returncode

    def __enter__(self) -> "PatchedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def request(
        self, method: str, path: str, payload: Any = None, timeout: float = 120.0
    ) -> tuple[int, Any]:
        """(status, decoded JSON body or text); HTTP errors are returned, not raised."""
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        text = body.decode("utf-8", errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def get_json(self, path: str) -> Any:
        return self._ok("GET", path)

    def post_json(self, path: str, payload: Any) -> Any:
        return self._ok("POST", path, payload)

    def _ok(self, method: str, path: str, payload: Any = None) -> Any:
        status, body = self.request(method, path, payload)
        if status != 200:
            raise ServerError(f"{method} {path} -> {status}: {body}")
        return body

    def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """POST /v1/chat/completions; greedy unless ``temperature`` is given."""
        payload = {"model": str(self.model_dir), "messages": messages, "temperature": 0.0}
        payload.update(params)
        return self.post_json("/v1/chat/completions", payload)
