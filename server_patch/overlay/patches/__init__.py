"""Patch topics: one module per concern, each exposing ``FILE_PATCHES``, listed in ``TOPICS``.

Nothing registers itself at import: ``load_topics()`` imports the listed topics and builds a
new registry from their ``FILE_PATCHES`` on every call, so a caller may change its copy
freely. Topic modules must not import mlx-vlm: they are loaded before the hook is installed,
and an mlx-vlm module imported then would stay unpatched.
"""

from __future__ import annotations

import importlib

from server_patch.overlay.edits import FilePatch, register

TOPICS = ("canary", "copyfree", "identity", "intake", "lineage", "loading", "pacing", "served_model",
          "sparse_attention", "speculative", "stock_stats", "tenant", "weights_path")


def load_topics() -> dict[str, FilePatch]:
    """Every topic's edits by module, merged in ``TOPICS`` order (a new dict each call)."""
    registry: dict[str, FilePatch] = {}
    for name in TOPICS:
        for file_patch in importlib.import_module(f"{__name__}.{name}").FILE_PATCHES:
            register(file_patch, registry)
    return registry
