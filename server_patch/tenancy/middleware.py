"""Every inference request's cache namespace, set before mlx-vlm reads its tenant header.

mlx-vlm salts its cache with ``X-APC-Tenant`` (or ``X-Tenant-Id``), and its answers report
``cached_tokens``: on a shared server that count tells one client how much of its prompt another
sent before (a token-exact prefix, probe by probe). This ASGI middleware replaces that header,
on every route outside ``/admin``, ``/health`` and the management routes, with the namespace
``server_patch.tenancy.namespace`` derives from three parts:

* the **API key** (``APC_API_KEYS``/``APC_API_KEY_FILE``, ``--api-key``): with keys configured a
  request without a valid one (or the admin token, which stands for the keyless namespace) gets
  401 JSON, and each key is its own namespace;
* the **tenant**: the header, or with ``APC_TENANT_FROM_USER=1`` the body's ``user`` (OpenAI)
  or ``metadata.user_id`` (Anthropic) field, for gateways that drop headers (smg 1.13 forwards
  only ``authorization``, ``x-request-id``, ``traceparent`` and a few more, docs/fleet.md). A
  blank header counts as none, and the field is read from any body mlx-vlm would parse (its
  handlers call ``request.json()`` whatever the content type). Opt-in, because clients that send
  a per-end-user ``user`` would otherwise split one shared cache per end user; and only as
  trustworthy as the client;
* vLLM's per-request **``cache_salt``** (any JSON body): nothing is shared across salts; one
  that is not a non-empty string is a 400.

The same namespace scopes mlx-vlm's stored Responses (``tenancy.responses``): the middleware
hands it to the handlers in a context variable, and an id another namespace stored is unknown.
The overlay's ``tenant`` topic (``overlay/patches/tenant.py``) adds it to mlx-vlm's app by one
call, ``install``. This module must not import mlx-vlm (it loads before the import hook).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable

from server_patch.infra.attributes import put_state, state_of
from server_patch.infra.auth import token_matches
from server_patch.infra.guard import (READ_METHODS, Receive, Scope, Send, classify, header, replaying, reply,
                                      route_path, with_headers)
from server_patch.infra.internal import INTERNAL
from server_patch.tenancy import responses
from server_patch.tenancy.namespace import namespace

if TYPE_CHECKING:
    from server_patch.tenancy.keys import ApiKeys

ENV = "APC_TENANT_FROM_USER"
TENANT_HEADER = b"x-apc-tenant"
HONOURED = (TENANT_HEADER, b"x-tenant-id")  # what mlx-vlm's _read_tenant_id reads (app.py:199-210)
MAX_TENANT_CHARS = 256  # a salt, not a document: longer values are ignored, not truncated
DEFAULT_TENANT_ENV = "APC_DEFAULT_TENANT"  # mlx-vlm's fallback tenant (app.py:203)
OPEN_PATHS = frozenset({"/health"})  # a probe's route: no key (stock mlx-vlm asks for its own key there)
UNAUTHORIZED = "missing or wrong API key (Authorization: Bearer <key>)"


def enabled(env: dict[str, str] | None = None) -> bool:
    from server_patch import settings

    return bool(settings.value(ENV, env))


def install(app: Any) -> None:
    """Add the middleware; a bad ``APC_TENANT_FROM_USER`` or unusable API keys stop the server here."""
    from server_patch.tenancy import keys

    try:
        on, api_keys = enabled(), keys.load()
    except ValueError as exc:
        raise SystemExit(f"server_patch: {exc}") from None
    app.add_middleware(RequestNamespace, api_keys=api_keys, from_user=on)
    put_state(app, apc_api_keys_on=api_keys is not None)  # /metrics' totals are then the admin token's


def parsed(body: bytes | None) -> dict[str, Any] | None:
    """A body's JSON object, parsed once for every field read here; None when it is not one."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def tenant_of(data: dict[str, Any] | None) -> str | None:
    """``user`` (OpenAI) or ``metadata.user_id`` (Anthropic) of a JSON body, if a usable string."""
    if data is None:
        return None
    metadata = data.get("metadata")
    value = data.get("user")
    if value is None and isinstance(metadata, dict):
        value = metadata.get("user_id")
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TENANT_CHARS:
        return None
    return value.strip()


def header_tenant(scope: Scope) -> str | None:
    """The tenant header mlx-vlm would honour, or None when absent or blank (never the shared tenant)."""
    for name in HONOURED:
        value = header(scope, name)
        if value is not None and value.strip():
            return value.strip().decode("latin-1")  # as Starlette hands it to mlx-vlm
    return None


def cache_salt_of(data: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """(the body's ``cache_salt``, None) or (None, why it is refused); (None, None) when absent."""
    if data is None or data.get("cache_salt") is None:
        return None, None
    salt = data["cache_salt"]
    if not isinstance(salt, str) or not salt:
        return None, "cache_salt must be a non-empty string if provided"
    return salt, None


class RequestNamespace:
    """API key check and cache namespace (key, tenant, ``cache_salt``) for every inference route."""

    def __init__(self, app: Callable, *, api_keys: ApiKeys | None = None, from_user: bool = False) -> None:
        self.app = app
        self.api_keys = api_keys
        self.from_user = from_user

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._applies(scope):
            await self.app(scope, receive, send)
            return
        key_id = None
        if self.api_keys is not None:
            key_id = self.api_keys.identity(header(scope, b"authorization"), header(scope, b"x-api-key"))
            if key_id is None and not _holds_admin_token(scope):
                await self._refuse(scope, receive, send)
                return
            scope = self._for_mlx_vlm(scope)
        data = None
        if scope["type"] == "http" and scope.get("method", "").upper() == "POST":
            body = await read_whole(receive)
            if body is None:
                return  # the client is gone: nothing to answer
            receive, data = replaying(body, receive), parsed(body)
        salt, refused = cache_salt_of(data)
        if refused:
            await reply(send, 400, refused)
            return
        name = self._namespace(scope, key_id, data, salt)
        responses.CURRENT.set(name)  # the Responses store's namespace (this request's task only)
        if name is not None:
            scope = with_headers(scope, drop=HONOURED, add=[(TENANT_HEADER, name.encode("utf-8"))])
        await self.app(scope, receive, send)

    def _namespace(self, scope: Scope, key_id: str | None, data: dict[str, Any] | None,
                   salt: str | None) -> str | None:
        """The request's namespace from its key, its tenant (header, else the opted-in user field) and salt."""
        tenant = header_tenant(scope) or (tenant_of(data) if self.from_user else None)
        if tenant is None and (key_id is not None or salt is not None):
            tenant = os.environ.get(DEFAULT_TENANT_ENV) or None  # what mlx-vlm would fall back to
        return namespace(key_id, tenant, salt)

    def _for_mlx_vlm(self, scope: Scope) -> Scope:
        """With ``MLX_VLM_SERVER_API_KEY`` also set, mlx-vlm's handlers check that key: hand it on."""
        upstream = self.api_keys.upstream if self.api_keys else None
        if upstream is None:
            return scope
        return with_headers(scope, drop=(b"authorization",), add=[(b"authorization", b"Bearer " + upstream)])

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
        """401 JSON; a websocket is accepted and closed with 1008 (a close code needs an open socket)."""
        if scope["type"] == "http":
            await reply(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            return
        if (await receive()).get("type") == "websocket.connect":
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 1008, "reason": UNAUTHORIZED})

    @staticmethod
    def _applies(scope: Scope) -> bool:
        if scope.get("type") not in ("http", "websocket") or scope.get(INTERNAL):
            return False  # an admin anchor's prefill names its namespace itself (its ``tenant``)
        path = route_path(scope)
        return path not in OPEN_PATHS and classify(path) != "admin" and not (
            classify(path) == "management" and scope.get("method", "GET").upper() not in READ_METHODS)


def _holds_admin_token(scope: Scope) -> bool:
    """The admin token stands in for a key, in the keyless namespace: an operator sees every namespace
    anyway, and ``apcctl restart``'s probe must reach the anchor ``/admin/anchors`` made there."""
    token = state_of(scope.get("app"), "apc_admin_token")  # Starlette puts itself in the scope first
    return bool(token) and token_matches(token, header(scope, b"authorization"))


async def read_whole(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)
