"""The inference body guard: size, depth, text and media checks before mlx-vlm parses a body.

Stock reads any body whole (the tenant middleware buffered it a second time) and lets
``json.loads`` meet a 100k-deep array (a ``RecursionError``, a 500 with a traceback). This ASGI
middleware reads every inference request body once, up to ``APC_INFERENCE_MAX_BODY_BYTES``
(413 JSON above it, chunked bodies included, using the admin guard's reader), and for a body
mlx-vlm would parse as JSON (any but a form upload: its handlers call ``request.json()``
whatever the content type) answers 400 JSON for what stock cannot handle: nesting past
``APC_INFERENCE_MAX_JSON_DEPTH``, a lone surrogate, an empty ``messages``, a media reference the
media policy refuses. A body that is not JSON is left for mlx-vlm to refuse as it does.
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable

from server_patch.admin.guard import (BODY_METHODS, Receive, Scope, Send, classify, header, read_capped, replaying,
                                      reply, route_path)
from server_patch.intake import checks, media
from server_patch.intake.limits import IntakeLimits

FORM_TYPES = (b"multipart/", b"application/x-www-form-urlencoded")


class InferenceBodyGuard:
    """Caps and checks every inference request body (``/admin`` and the management routes have their own)."""

    def __init__(self, app: Callable, *, limits: IntakeLimits, policy: media.MediaPolicy) -> None:
        self.app = app
        self.limits = limits
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _applies(scope):
            await self.app(scope, receive, send)
            return
        body = await read_capped(scope, receive, send, self.limits, "APC_INFERENCE_MAX_BODY_BYTES")
        if body is None:
            return
        content_type = (header(scope, b"content-type") or b"").lower()
        if body and not content_type.startswith(FORM_TYPES):
            why = await self._refusal(route_path(scope), body)
            if why:
                await reply(send, 400, why)
                return
        await self.app(scope, replaying(body, receive), send)

    async def _refusal(self, path: str, body: bytes) -> str | None:
        try:
            data = json.loads(body)
        except RecursionError:
            return (f"request JSON nests deeper than {self.limits.max_json_depth} levels "
                    "(APC_INFERENCE_MAX_JSON_DEPTH)")
        except (ValueError, UnicodeDecodeError):
            return None  # not JSON: mlx-vlm answers it as it does
        why = checks.refusal(path, data, self.limits.max_json_depth)
        if why:
            return why
        references = list(media.references(data))
        if not references:
            return None
        return await asyncio.to_thread(_first_refusal, references, self.policy)  # DNS may block


def _first_refusal(references: list[str], policy: media.MediaPolicy) -> str | None:
    for reference in references:
        why = media.refusal(reference, policy)
        if why:
            return why
    return None


def _applies(scope: Scope) -> bool:
    return (scope.get("type") == "http" and scope.get("method", "").upper() in BODY_METHODS
            and classify(route_path(scope)) is None)
