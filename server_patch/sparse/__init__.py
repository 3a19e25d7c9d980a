"""glm5_next sparse attention for mlx-vlm 0.7.10: the path per chunk, and the tools around it.

* ``dispatch``: ``attend(layer, ...)``, the drop-in for ``Glm5NextAttention._attend``, and the
  rule choosing per chunk between the stock decode loop, the batched gather and the unabsorbed
  path (``choose_path``).
* ``gathered``: the decode shape batched over a chunk's queries.
* ``projected``: the per-head projected K/V cache as derived state (``is_projected_child``).
* ``profiler``: the flag-file per-layer timer.

Names are resolved lazily so that ``apcctl`` (which never imports mlx) can use the profiler.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "attend": "dispatch",
    "choose_path": "dispatch",
    "is_projected_child": "projected",
    "projected_child_index": "projected",
    "projected_slot": "projected",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
