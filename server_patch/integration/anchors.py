"""Names the overlay and the admin API import from here (the code is in ``server_patch.boundaries``
and ``server_patch.integration.segments``)."""

from server_patch.boundaries.anchors import AnchorRegistry
from server_patch.boundaries.anchors import anchor_label as label
from server_patch.integration.segments import wrap_apply_chat_template

__all__ = ["AnchorRegistry", "label", "wrap_apply_chat_template"]
