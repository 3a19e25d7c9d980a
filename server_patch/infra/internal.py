"""Call the server's own chat route in-process (pin-an-anchor prefills through the real path)."""

from __future__ import annotations

import json
from typing import Any

from server_patch.infra.asgi import ASGIApp

INTERNAL = "apc.internal"  # the scope key that marks this server's own in-process requests


async def internal_chat(app: ASGIApp, payload: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
    """POST /v1/chat/completions to ``app`` over ASGI; returns (status, parsed body or text)."""
    body = json.dumps(payload).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "query_string": b"", "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        INTERNAL: True,  # no client can put this in a scope: the namespace middleware lets it pass as sent
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *((k.lower().encode(), v.encode()) for k, v in headers.items())],
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    status = 500
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception as exc:  # the route raised (e.g. HTTPException outside its middleware)
        return getattr(exc, "status_code", 500), str(getattr(exc, "detail", exc))
    raw = b"".join(chunks)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")
