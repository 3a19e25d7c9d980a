"""The gate in front of ``/admin`` and mlx-vlm's own management routes.

mlx-vlm answers ``POST /unload``, ``PATCH /v1/settings`` and ``POST /v1/cache/reset`` to anyone
and installs a CORS middleware that lets every origin read every answer, with credentials, so
any web page a local user opens could reach them on loopback. This ASGI middleware sits
outside mlx-vlm's CORS middleware and, for those routes and ``/admin`` only:

* answers a CORS preflight itself (403, no ``Access-Control-Allow-*`` headers) and hides the
  ``Origin`` header from the CORS middleware, so CORS never applies to them;
* requires the admin token (401 JSON) on ``/admin`` and on the management routes' writes;
* caps request bodies (413 JSON), chunked ones included;
* caps concurrent ``/admin/events`` streams (429 JSON with ``Retry-After``).

Inference routes pass through untouched here: ``server_patch.serving.origins`` guards their
origins (and every route's ``Host``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, TypeVar, cast

from server_patch.infra.auth import token_matches
from server_patch.envconfig import env_values

from server_patch.infra.asgi import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ADMIN_PREFIX = "/admin"
EVENTS_PATH = "/admin/events"
# mlx-vlm 0.7.10's routes that change server state (and their unversioned aliases).
MANAGEMENT_PATHS = frozenset({"/unload", "/v1/settings", "/settings", "/v1/cache/reset", "/cache/reset"})
READ_METHODS = frozenset({"GET", "HEAD"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
API_KEY_ENV = "MLX_VLM_SERVER_API_KEY"  # mlx-vlm's own key for these routes, when set
STREAM_RETRY_AFTER_S = 5
UNAUTHORIZED = "missing or wrong admin token (Authorization: Bearer <token>)"


@dataclass(frozen=True)
class AdminLimits:
    """``APC_ADMIN_MAX_EVENT_STREAMS`` and ``APC_ADMIN_MAX_BODY_BYTES`` (``1M``, ``512K``...)."""

    max_event_streams: int = 8
    max_body_bytes: int = 1 << 20

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "AdminLimits":
        return limits_from_env(cls, "APC_ADMIN_", env)

    @property
    def drain_bytes(self) -> int:
        return drain_bytes_for(self.max_body_bytes)


class BodyLimits(Protocol):
    """What :func:`read_body` needs: the cap, and how much of a larger body is read and dropped."""

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def drain_bytes(self) -> int: ...


L = TypeVar("L", bound="DataclassInstance")


def limits_from_env(cls: type[L], prefix: str, env: Mapping[str, str] | None = None) -> L:
    """A limits dataclass from ``<prefix><FIELD>`` variables; every limit must be >= 1."""
    names = {f.name: f"{prefix}{f.name.upper()}" for f in fields(cls)}
    limits = cls(**env_values(cls, names, os.environ if env is None else env))
    for f in fields(cls):
        if getattr(limits, f.name) < 1:
            raise ValueError(f"{names[f.name]} must be >= 1, got {getattr(limits, f.name)}")
    return limits


def drain_bytes_for(max_body_bytes: int) -> int:
    """How much of an oversized body is read and dropped so the client sees the 413."""
    return max(16 * max_body_bytes, 16 << 20)


class StreamCount:
    """Open ``/admin/events`` streams; touched only on the server's event loop. ``STREAMS`` is the
    process's, on purpose: it bounds the one HTTP server's open streams (mlx-vlm serves one app
    per process), whichever runtime they read; it holds a count, no runtime's state."""

    def __init__(self) -> None:
        self.open = 0


STREAMS = StreamCount()


def route_path(scope: Scope) -> str:
    """The path the router matches (``root_path`` removed, trailing slashes ignored)."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        path = path[len(root):]
    return path.rstrip("/") or "/"


def classify(path: str) -> str | None:
    """``"admin"``, ``"management"`` or None (inference and everything else)."""
    if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
        return "admin"
    if path in MANAGEMENT_PATHS:
        return "management"
    return None


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return cast(bytes, value)
    return None


def with_headers(scope: Scope, drop: Iterable[bytes], add: Iterable[tuple[bytes, bytes]] = ()) -> Scope:
    dropped = set(drop)
    kept = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in dropped]
    return {**scope, "headers": [*kept, *add]}


async def reply(send: Send, status: int, detail: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A JSON ``{"detail": ...}`` answer, shaped like FastAPI's own errors."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def read_body(scope: Scope, receive: Receive, limits: BodyLimits) -> tuple[str, bytes]:
    """("ok", body), ("too_big", b"") or ("gone", b""): the whole body, at most the cap.

    An oversized body is still read (and dropped) up to ``limits.drain_bytes``: closing the
    connection with unread bytes makes the client see a reset instead of the 413.
    """
    declared = header(scope, b"content-length")
    try:
        length = int(declared) if declared is not None else None
    except ValueError:
        length = None
    if length is not None and length > limits.drain_bytes:
        return "too_big", b""
    chunks: list[bytes] = []
    total, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return "gone", b""
        data = message.get("body", b"")
        total += len(data)
        more = bool(message.get("more_body", False))
        if total <= limits.max_body_bytes:
            chunks.append(data)
        elif total > limits.drain_bytes:
            break
    if total > limits.max_body_bytes:
        return "too_big", b""
    return "ok", b"".join(chunks)


async def read_capped(scope: Scope, receive: Receive, send: Send, limits: BodyLimits, setting: str) -> bytes | None:
    """The whole body, or None once answered: a 413 JSON naming ``setting`` for an oversized
    one, nothing for a client that left while sending it."""
    outcome, body = await read_body(scope, receive, limits)
    if outcome == "too_big":
        await reply(send, 413, f"request body is larger than {limits.max_body_bytes} bytes ({setting})",
                    [(b"connection", b"close")])
    return body if outcome == "ok" else None


def replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the client's later messages."""
    pending = True

    async def replay() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class AdminGuard:
    """Token, CORS, body and stream limits for ``/admin`` and the management routes."""

    def __init__(self, app: ASGIApp, *, token: str, limits: AdminLimits,
                 streams: StreamCount = STREAMS) -> None:
        self.app = app
        self.token = token
        self.limits = limits
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = classify(route_path(scope)) if scope.get("type") == "http" else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET").upper()
        if method == "OPTIONS" and header(scope, b"access-control-request-method") is not None:
            await reply(send, 403, "cross-origin requests are not accepted on /admin and the management routes")
            return
        scope = with_headers(scope, drop=(b"origin",))  # mlx-vlm's CORS middleware never sees one
        needs_token = kind == "admin" or method not in READ_METHODS
        if needs_token:
            authorized, scope = self._authorize(scope, kind)
            if not authorized:
                await reply(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
                return
        if method in BODY_METHODS:
            body = await read_capped(scope, receive, send, self.limits, "APC_ADMIN_MAX_BODY_BYTES")
            if body is None:
                return
            receive = replaying(body, receive)
        if route_path(scope) == EVENTS_PATH and method in READ_METHODS:
            await self._stream(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorize(self, scope: Scope, kind: str) -> tuple[bool, Scope]:
        """Whether the request carries the admin token (or mlx-vlm's own key on its routes).

        With ``MLX_VLM_SERVER_API_KEY`` set, mlx-vlm's handlers check that key themselves; a
        request holding the admin token is passed on with the key, so either one works.
        """
        supplied = header(scope, b"authorization")
        admin_ok = token_matches(self.token, supplied)
        if kind != "management":
            return admin_ok, scope
        api_key = os.environ.get(API_KEY_ENV)
        if not api_key:
            return admin_ok, scope
        expected_key = os.fsencode(api_key)
        if token_matches(expected_key, supplied):
            return True, scope
        if admin_ok:
            return True, with_headers(scope, drop=(b"authorization",),
                                      add=[(b"authorization", b"Bearer " + expected_key)])
        return False, scope

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One more ``/admin/events`` stream, or 429 when the cap is reached."""
        if self.streams.open >= self.limits.max_event_streams:
            await reply(send, 429, f"too many open event streams ({self.streams.open} of "
                                   f"{self.limits.max_event_streams}, APC_ADMIN_MAX_EVENT_STREAMS); "
                                   "close one or retry later",
                        [(b"retry-after", str(STREAM_RETRY_AFTER_S).encode())])
            return
        self.streams.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.streams.open -= 1


def install_outermost(app: Any, middleware: Callable[..., ASGIApp] = AdminGuard, **options: Any) -> None:
    """Put ``middleware`` (:class:`AdminGuard`) outside every middleware mlx-vlm adds (its CORS
    one included).

    ``install`` runs where the admin router is mounted, before mlx-vlm adds its middleware,
    and Starlette builds the stack only at the first request; so the guard joins the list then,
    as its outermost entry (still inside Starlette's error middleware: no traceback leaks).
    """
    from starlette.middleware import Middleware

    build = app.build_middleware_stack

    def build_with_guard() -> Any:
        if not any(m.cls is middleware for m in app.user_middleware):
            app.user_middleware.insert(0, Middleware(middleware, **options))
        return build()

    app.build_middleware_stack = build_with_guard
