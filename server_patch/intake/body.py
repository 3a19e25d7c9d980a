"""The inference body guard: size, depth, text and media checks before mlx-vlm parses a body.

Stock reads any body whole (the tenant middleware buffered it a second time) and lets
``json.loads`` meet a 100k-deep array (a ``RecursionError``, a 500 with a traceback). This ASGI
middleware reads every inference request body once, up to ``APC_INFERENCE_MAX_BODY_BYTES``
(413 JSON above it, chunked bodies included, using the admin guard's reader), and for a body
mlx-vlm would parse as JSON (any but a form upload: its handlers call ``request.json()``
whatever the content type) answers 400 JSON for what stock cannot handle: nesting past
``APC_INFERENCE_MAX_JSON_DEPTH``, a lone surrogate, an empty ``messages``, a media reference the
media policy refuses, an inline image that does not decode. A body that is not JSON is left for
mlx-vlm to refuse as it does. The checks walk any JSON (issue 34: a tool schema's ``"type":
["integer", "null"]`` was a 500); should a shape check still fail on a body, the body goes on
as stock takes it, while one whose media cannot be checked is refused (the policy fails closed).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

from server_patch.infra.guard import (BODY_METHODS, Receive, Scope, Send, classify, header, read_capped, replaying,
                                      reply, route_path)
from server_patch.intake import checks, data_images, media
from server_patch.intake.limits import IntakeLimits

log = logging.getLogger("server_patch.intake")

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
        return _shape_refusal(path, data, self.limits.max_json_depth) or await _media_refusal(data, self.policy)


def _shape_refusal(path: str, data: object, max_depth: int) -> str | None:
    """The shape checks' refusal; a body they cannot classify goes to mlx-vlm as stock takes it."""
    try:
        return checks.refusal(path, data, max_depth)
    except Exception:  # noqa: BLE001 - these checks only spare stock its own 500s: never cause one
        log.exception("intake: the shape checks failed on a request body; passing it on unchecked")
        return None


async def _media_refusal(data: object, policy: media.MediaPolicy) -> str | None:
    """The media policy's (or a broken inline image's) refusal; one that cannot be checked is refused."""
    try:
        references = [*media.references(data), *data_images.anthropic_sources(data)]
        if not references:
            return None
        return await asyncio.to_thread(_first_refusal, references, policy)  # DNS and decoding may block
    except Exception:  # noqa: BLE001 - the policy guards what the server fetches: fail closed, as a 400
        log.exception("intake: a request's media references could not be checked; refusing it")
        return "the request's media references could not be checked"


def _first_refusal(references: list[str], policy: media.MediaPolicy) -> str | None:
    for reference in references:
        why = media.refusal(reference, policy) or data_images.refusal(reference)
        if why:
            return why
    return None


def _applies(scope: Scope) -> bool:
    return (scope.get("type") == "http" and scope.get("method", "").upper() in BODY_METHODS
            and classify(route_path(scope)) is None)
