"""Patch topics: one module per concern, each exposing ``FILE_PATCHES`` (or calling
``register`` when imported). Topic modules must not import mlx-vlm: they are loaded before
the hook is installed, and an mlx-vlm module imported then would stay unpatched. Prefer
``FILE_PATCHES``: ``load_topics(fresh_registry)`` re-reads it, while a ``register`` call runs
only on the first import and only into ``PATCHES``.
"""

from __future__ import annotations

import importlib
import pkgutil

from server_patch.overlay.edits import PATCHES, FilePatch, register


def load_topics(registry: dict[str, FilePatch] | None = None) -> dict[str, FilePatch]:
    """Import every topic in name order and merge its edits into ``registry`` (PATCHES)."""
    registry = PATCHES if registry is None else registry
    for info in sorted(pkgutil.iter_modules(__path__, __name__ + "."), key=lambda i: i.name):
        topic = importlib.import_module(info.name)
        for file_patch in getattr(topic, "FILE_PATCHES", ()):
            register(file_patch, registry)
    return registry
