"""Inline ``data:image/...`` URIs decoded before mlx-vlm meets them: a broken one is the client's error.

Stock mlx-vlm 0.7.10's ``load_image`` base64-decodes a ``data:image/`` URI and opens it with
Pillow; bad base64, a truncated PNG or bytes that are no image raise inside the handler and the
client gets a 500 with a traceback in the log (issue 34, item 16). The body guard decodes each
such URI the same way first (off the event loop), Anthropic base64 image blocks included (mlx-vlm
turns them into such URIs), and answers 400 saying which image is broken.
A URI that decodes here decodes in the loader too: the same lenient base64 and the same Pillow
calls. The cost is one extra decode per inline image.
"""

from __future__ import annotations

import base64
import binascii
from io import BytesIO
from typing import Any, Iterator

PREFIX = "data:image/"  # what stock's loader treats as an inline image


def anthropic_sources(data: Any) -> Iterator[str]:
    """The ``data:`` URIs mlx-vlm builds from Anthropic ``{"type": "image", "source": {"type":
    "base64", ...}}`` blocks (``anthropic.py``'s ``_anthropic_image_source_to_ref``), anywhere in a body."""
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            source = node.get("source")
            if node.get("type") == "image" and isinstance(source, dict) and source.get("type") == "base64":
                payload, media_type = source.get("data"), source.get("media_type") or "image/png"
                if payload and isinstance(payload, str) and isinstance(media_type, str):
                    yield f"data:{media_type};base64,{payload}"
            stack.extend(value for value in node.values() if isinstance(value, (dict, list)))


def refusal(reference: Any) -> str | None:
    """Why an inline image cannot be read (a sentence for a 400), or None (also for any other reference)."""
    if not isinstance(reference, str) or not reference.startswith(PREFIX):
        return None
    if "," not in reference:
        return "inline image (data:image/...) has no ',' before its data"
    header, payload = reference.split(",", 1)
    try:
        raw = base64.b64decode(payload)  # lenient, as stock decodes it
    except (binascii.Error, ValueError) as exc:
        return f"inline image ({header[:60]}) is not valid base64: {exc}"
    try:
        _decode(raw)
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for broken files; each is the client's
        return f"inline image ({header[:60]}) is not a readable image: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def _decode(raw: bytes) -> None:
    """Open, orient and convert as stock's ``load_image`` does, so every pixel is decoded."""
    from PIL import Image, ImageOps

    with Image.open(BytesIO(raw)) as image:
        ImageOps.exif_transpose(image).convert("RGB")
