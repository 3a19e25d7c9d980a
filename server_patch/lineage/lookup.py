"""Longest common prefix of a prompt against stored token arrays, with numpy."""

from __future__ import annotations

import numpy as np

# Compare in blocks so entries that diverge early cost one small compare, not a whole row.
_BLOCK = 4096


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading positions where ``a`` and ``b`` agree."""
    limit = min(int(a.shape[0]), int(b.shape[0]))
    start = 0
    while start < limit:
        stop = min(limit, start + _BLOCK if start == 0 else start * 4)
        differ = a[start:stop] != b[start:stop]
        first = int(np.argmax(differ))
        if differ[first]:
            return start + first
        start = stop
    return limit

