"""Where a chat prompt's template segments end: anchors and segment boundaries, as token lengths.

A pure package: it imports neither MLX nor mlx-vlm (``tests/test_layout.py`` checks it), so the
replay simulator and the tests use it without a model. The server's side, which renders with
mlx-vlm's ``apply_chat_template`` and owns the one finder, is ``server_patch.integration.segments``.
"""

from server_patch.boundaries.anchors import AnchorMatch, AnchorRegistry, anchor_label
from server_patch.boundaries.finder import SegmentFinder
from server_patch.boundaries.kinds import BPE_SLACK, Kind
from server_patch.boundaries.notes import SegmentInfo
from server_patch.boundaries.settings import SegmentSettings

__all__ = ["AnchorMatch", "AnchorRegistry", "BPE_SLACK", "Kind", "SegmentFinder", "SegmentInfo",
           "SegmentSettings", "anchor_label"]
