"""A tenant that survives a gateway: the request's own ``user`` field, when the operator opts in.

mlx-vlm salts its cache with ``X-APC-Tenant`` (or ``X-Tenant-Id``), but a gateway in front of
several servers need not pass that header on: smg 1.13 forwards only ``authorization``,
``x-request-id``(``-*``), ``x-correlation-id``, ``traceparent``/``tracestate`` and
``x-smg-routing-key``, and drops the rest (checked against the real binary, docs/fleet.md). It
forwards the JSON body unchanged, though, and the OpenAI API has a field for exactly this: ``user``,
"a unique identifier representing your end-user" (``user=`` in the OpenAI SDK); Anthropic's is
``metadata.user_id``. With ``APC_TENANT_FROM_USER=1`` this ASGI middleware turns that field into
the ``X-APC-Tenant`` header before mlx-vlm reads it, so every route that honours the header (chat,
completions, responses, messages, compaction) honours the field too. Opt-in, because clients that
send a per-end-user ``user`` would otherwise split one shared cache per end user. A tenant header
the request carries itself wins; ``/admin`` and the management routes are left alone (an anchor
names its tenant in its own body). This module must not import mlx-vlm (topics load before the import hook).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from server_patch.admin.guard import Receive, Scope, Send, classify, header, replaying, route_path, with_headers
from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

ENV = "APC_TENANT_FROM_USER"
TENANT_HEADER = b"x-apc-tenant"
HONOURED = (TENANT_HEADER, b"x-tenant-id")  # what mlx-vlm's _read_tenant_id reads (app.py:199-210)
MAX_TENANT_CHARS = 256  # a salt, not a document: longer values are ignored, not truncated

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.server.app",
        Edit(
            name="tenant.from_user",
            old="app.add_middleware(\n    CORSMiddleware,\n",
            new=(
                "from server_patch.overlay.patches.tenant import install as _apc_tenant_install\n"
                "\n"
                "_apc_tenant_install(app)\n"
                "\n"
                "app.add_middleware(\n    CORSMiddleware,\n"
            ),
        ),
    ),
)


def enabled(env: dict[str, str] | None = None) -> bool:
    from server_patch import settings

    return bool(settings.value(ENV, env))


def install(app: Any) -> None:
    """Add the middleware when ``APC_TENANT_FROM_USER`` is on; a bad value stops the server here."""
    try:
        on = enabled()
    except ValueError as exc:
        raise SystemExit(f"server_patch: {exc}") from None
    if on:
        app.add_middleware(TenantFromUser)


def tenant_of(body: bytes) -> str | None:
    """``user`` (OpenAI) or ``metadata.user_id`` (Anthropic) of a JSON body, if a usable string."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    metadata = data.get("metadata")
    value = data.get("user")
    if value is None and isinstance(metadata, dict):
        value = metadata.get("user_id")
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TENANT_CHARS:
        return None
    return value.strip()


class TenantFromUser:
    """For JSON POSTs outside ``/admin`` with no tenant header: the body's user as ``X-APC-Tenant``."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._applies(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone: nothing to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        tenant = tenant_of(body)
        if tenant is not None:
            scope = with_headers(scope, drop=(), add=[(TENANT_HEADER, tenant.encode("utf-8"))])
        await self.app(scope, replaying(body, receive), send)

    @staticmethod
    def _applies(scope: Scope) -> bool:
        if scope.get("type") != "http" or scope.get("method", "").upper() != "POST":
            return False
        if classify(route_path(scope)) is not None:  # /admin and mlx-vlm's management routes
            return False
        if any(header(scope, name) is not None for name in HONOURED):
            return False
        content_type = (header(scope, b"content-type") or b"").lower()
        return content_type.startswith(b"application/json")
