"""Requests in flight and draining, as a pure ASGI middleware in front of mlx-vlm's app.

A request is in flight from its first byte until the last byte of its response body, which
for streamed completions is the end of the stream: exactly what a restart must wait for.
While draining, new inference requests get 503 with ``Retry-After`` (a websocket is closed
with 1013, try again later, before its endpoint runs); admin, health and metrics routes keep
answering so operators and supervisors can watch the drain. A request still in flight
``APC_DRAIN_STREAM_DEADLINE_S`` after the drain began is ended (``drain_deadline``), so one slow
client cannot keep a restart from happening.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from server_patch import clock
from server_patch.infra import drain_deadline
from server_patch.infra.asgi import ASGIApp, Message, Receive, Scope, Send


DRAINING_MESSAGE = "server is draining for a restart; retry shortly"
_ALWAYS_OPEN = ("/admin", "/health", "/metrics", "/v1/metrics", "/docs", "/openapi.json", "/redoc")


class Traffic:
    """Counters the admin endpoint and the canary read; one per server (``integration.parts``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Set when the server begins to shut down: long-lived streams (/admin/events) end, or
        # uvicorn would wait for them forever and a stop would end in SIGKILL, skipping the flush.
        self.shutting_down = threading.Event()
        self.in_flight = 0
        self._draining = False
        self._cut_at: float | None = None  # monotonic: requests still in flight then are ended
        self.retry_after = 5
        self.last_finished: float | None = None
        self.rejected = 0

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        """A drain that begins sets the deadline of what is in flight (a repeated drain keeps it)."""
        with self._lock:
            if value and not self._draining:
                deadline = drain_deadline.deadline_s()
                self._cut_at = None if deadline is None else clock.monotonic() + deadline
            elif not value:
                self._cut_at = None
            self._draining = value

    def cut_at(self) -> float | None:
        """When requests still in flight are ended (None: no drain, or no deadline)."""
        return self._cut_at

    def start(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finish(self) -> None:
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)
            self.last_finished = clock.monotonic()  # intervals only: a stepped wall clock must not move them

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            idle = None if self.last_finished is None else clock.monotonic() - self.last_finished
            return {"in_flight": self.in_flight, "draining": self.draining,
                    "retry_after_s": self.retry_after, "since_last_finished_s": idle,
                    "rejected_while_draining": self.rejected}



def counted(path: str) -> bool:
    """Inference traffic: everything but the admin, health and metrics routes."""
    return not any(path == p or path.startswith(p + "/") for p in _ALWAYS_OPEN)


class TrafficMiddleware:
    """Counts in-flight inference requests and turns them away while draining."""

    def __init__(self, app: ASGIApp, traffic: Traffic) -> None:
        self.app = app
        self.traffic = traffic

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") not in ("http", "websocket") or not counted(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        if self.traffic.draining:
            self.traffic.rejected += 1
            if scope["type"] == "http":
                await self._refuse_http(send)
            else:
                await self._refuse_websocket(receive, send)
            return
        self.traffic.start()
        finished = False

        async def tracking_send(message: Message) -> None:
            nonlocal finished
            await send(message)
            if message.get("type") == "http.response.body" and not message.get("more_body", False):
                if not finished:
                    finished = True
                    self.traffic.finish()

        try:
            if scope["type"] == "http":
                await self._until_drain_deadline(scope, receive, tracking_send)
            else:
                await self.app(scope, receive, tracking_send)
        finally:
            if not finished:
                self.traffic.finish()

    async def _until_drain_deadline(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; past a drain's deadline, end its request (``drain_deadline``)."""
        state = drain_deadline.ResponseState()
        cut = asyncio.Event()

        async def app_send(message: Message) -> None:
            if cut.is_set():
                return  # ended: the final words are the middleware's
            state.saw(message)
            await send(message)

        async def app_receive() -> Message:
            """The client's messages, and ``http.disconnect`` once the request is ended."""
            if cut.is_set():
                return {"type": "http.disconnect"}
            message, ended = asyncio.ensure_future(receive()), asyncio.ensure_future(cut.wait())
            await asyncio.wait({message, ended}, return_when=asyncio.FIRST_COMPLETED)
            if message.done():
                ended.cancel()
                return message.result()
            message.cancel()
            return {"type": "http.disconnect"}

        app = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        deadline = asyncio.ensure_future(drain_deadline.passed(self.traffic.cut_at))
        try:
            await asyncio.wait({app, deadline}, return_when=asyncio.FIRST_COMPLETED)
            if app.done():
                app.result()  # the app's own exception, as before
                return
            cut.set()  # the app sees its client gone: the row is cancelled at its next step
            await asyncio.wait({app}, timeout=drain_deadline.FINAL_WRITE_S)  # ... and may end itself
            app.cancel()  # a send blocked on a full socket ends here
            if not state.finished:
                await drain_deadline.end(scope, send, state, drain_deadline.deadline_s() or 0.0)
        finally:
            deadline.cancel()
            if not app.done():
                app.cancel()

    async def _refuse_http(self, send: Send) -> None:
        body = json.dumps({"error": {"message": DRAINING_MESSAGE, "type": "server_draining"}}).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(self.traffic.retry_after).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _refuse_websocket(self, receive: Receive, send: Send) -> None:
        """A websocket never reaches its endpoint while draining: it is closed at once with 1013
        (try again later) and the reason, as mlx-vlm's own realtime route does when busy.

        It is accepted first because a close code only reaches the client on an open socket; a
        handshake denial (HTTP 503) would carry ``Retry-After`` but browsers hide it, and
        uvicorn logs an error for every denial.
        """
        message = await receive()
        if message.get("type") != "websocket.connect":
            return  # the client went away first
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1013,
                    "reason": f"{DRAINING_MESSAGE} (retry after {self.traffic.retry_after} s)"})
