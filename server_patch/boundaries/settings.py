"""The knobs of boundary finding, read from ``APC_SEGMENTS_*`` when a server starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Mapping

from server_patch.envconfig import env_values

# Environment variable -> SegmentSettings field.
ENV = {
    "APC_SEGMENTS": "enabled",
    "APC_SEGMENTS_FALLBACK_STRIDE": "fallback_stride",
    "APC_SEGMENTS_TOOLS": "tool_boundaries",
    "APC_SEGMENTS_SYSTEM_PARAGRAPHS": "system_paragraphs",
    "APC_SEGMENTS_ANCHOR_TAIL": "anchor_tail_tokens",
    "APC_SEGMENTS_MAX_NEW_RENDERS": "max_new_renders",
}


@dataclass(frozen=True)
class SegmentSettings:
    """Knobs, read from ``APC_SEGMENTS_*``."""

    enabled: bool = True
    # Segments when no template boundaries are known (0: none).
    fallback_stride: int = 2048
    # Boundaries between tools inside the tools block. Off by default: with the current policy
    # they are adopted by the anchor and crowd out the tools end (docs/segments.md).
    tool_boundaries: bool = False
    # Paragraph breaks reported per system message, the last ones (-1: all, 0: none). mlx-vlm
    # 0.7.10 joins every system/developer message into one with "\n\n", so these are also where
    # the client's system messages ended (a clock, a session note, a variant's last section).
    system_paragraphs: int = 2
    # Finer points inside a long system message (line, heading and section starts, the system
    # text's end; ``boundaries.system_points``), thinned to ``system_paragraphs`` of them. Not
    # an environment setting: False is the finder as it was before them, for a replay's before.
    system_points: bool = True
    # Renders a request may add to the cache (a cold 200-message conversation renders the
    # newest ones); 0 means no limit.
    max_new_renders: int = 8
    # Trailing leading-system messages shorter than this (in total) stay out of the anchor.
    anchor_tail_tokens: int = 256
    max_notes: int = 64
    walk_candidates: int = 16
    render_cache_entries: int = 16_384
    piece_cache_tokens: int = 8_000_000

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "SegmentSettings":
        """``APC_SEGMENTS`` (on/off) and ``APC_SEGMENTS_<NAME>`` for the fields in ``ENV``."""
        env = os.environ if env is None else env
        values = env_values(cls, {name: key for key, name in ENV.items()}, env)
        for name, value in values.items():
            if not isinstance(value, bool) and value < (-1 if name == "system_paragraphs" else 0):
                key = next(k for k, n in ENV.items() if n == name)
                raise ValueError(f"{key} must be >= 0, got {value}")
        return replace(cls(), **values)
