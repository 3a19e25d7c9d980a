"""The whole patch as a unified diff, pristine vs patched, for review."""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from server_patch.overlay.edits import FilePatch, apply
from server_patch.overlay.verify import pristine_text


def unified_diff(registry: Mapping[str, FilePatch] | None = None, context: int = 3) -> str:
    """``diff -u`` of every patched file (a/ = installed pristine, b/ = patched)."""
    if registry is None:
        from server_patch.overlay.patches import load_topics

        registry = load_topics()
    chunks = []
    for module in sorted(registry):
        patch = registry[module]
        old = pristine_text(patch)
        new = apply(patch, old)
        chunks.extend(
            difflib.unified_diff(
                old.splitlines(keepends=True),
                new.splitlines(keepends=True),
                fromfile=f"a/{patch.relpath}",
                tofile=f"b/{patch.relpath}",
                n=context,
            )
        )
    return "".join(chunks)
