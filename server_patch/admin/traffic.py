"""Requests in flight and draining, as a pure ASGI middleware in front of mlx-vlm's app.

A request is in flight from its first byte until the last byte of its response body, which
for streamed completions is the end of the stream: exactly what a restart must wait for.
While draining, new inference requests get 503 with ``Retry-After``; admin, health and metrics
routes keep answering so operators and supervisors can watch the drain.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

_ALWAYS_OPEN = ("/admin", "/health", "/metrics", "/v1/metrics", "/docs", "/openapi.json", "/redoc")


class Traffic:
    """Counters the admin endpoint reads; one per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Set when the server begins to shut down: long-lived streams (/admin/events) end, or
        # uvicorn would wait for them forever and a stop would end in SIGKILL, skipping the flush.
        self.shutting_down = threading.Event()
        self.in_flight = 0
        self.draining = False
        self.retry_after = 5
        self.last_finished: float | None = None
        self.rejected = 0

    def start(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finish(self) -> None:
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)
            self.last_finished = time.time()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            idle = None if self.last_finished is None else time.time() - self.last_finished
            return {"in_flight": self.in_flight, "draining": self.draining,
                    "retry_after_s": self.retry_after, "since_last_finished_s": idle,
                    "rejected_while_draining": self.rejected}


TRAFFIC = Traffic()


def counted(path: str) -> bool:
    """Inference traffic: everything but the admin, health and metrics routes."""
    return not any(path == p or path.startswith(p + "/") for p in _ALWAYS_OPEN)


class TrafficMiddleware:
    """Counts in-flight inference requests and turns them away while draining."""

    def __init__(self, app: Callable, traffic: Traffic = TRAFFIC) -> None:
        self.app = app
        self.traffic = traffic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") not in ("http", "websocket") or not counted(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        if self.traffic.draining and scope["type"] == "http":
            self.traffic.rejected += 1
            body = json.dumps({"error": {"message": "server is draining for a restart; retry shortly",
                                         "type": "server_draining"}}).encode()
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"),
                (b"retry-after", str(self.traffic.retry_after).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        self.traffic.start()
        finished = False

        async def tracking_send(message: dict) -> None:
            nonlocal finished
            await send(message)
            if message.get("type") == "http.response.body" and not message.get("more_body", False):
                if not finished:
                    finished = True
                    self.traffic.finish()

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            if not finished:
                self.traffic.finish()
