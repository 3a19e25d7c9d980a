"""Longest common prefix of a prompt against every earlier prompt.

Used by the oracle (the best any cache could do) and by the trace writer (which stores a prompt
as "record i's first k tokens plus these"). A prompt that is a prefix of a later one can never
give a longer match than the later one, so it is dropped: conversations keep the set small.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from server_patch.lineage.lookup import common_prefix_len


@dataclass
class PrefixSet:
    """Token arrays with a label each; answers "longest shared prefix with any of them"."""

    _items: list[tuple[np.ndarray, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._items)

    def longest(self, tokens: np.ndarray) -> tuple[int, int]:
        """(shared length, label of the array sharing it); (0, -1) when empty."""
        best, label = 0, -1
        for stored, stored_label in self._items:
            if stored.shape[0] <= best:
                continue
            lcp = common_prefix_len(tokens, stored)
            if lcp > best:
                best, label = lcp, stored_label
        return best, label

    def add(self, tokens: np.ndarray, label: int) -> None:
        """Remember ``tokens``; arrays it extends are forgotten (it answers for them)."""
        n = tokens.shape[0]
        kept = []
        for stored, stored_label in self._items:
            m = stored.shape[0]
            if m <= n and common_prefix_len(tokens, stored) == m:
                continue
            if m >= n and common_prefix_len(tokens, stored) == n:
                return  # already covered by a longer array
            kept.append((stored, stored_label))
        kept.append((tokens, label))
        self._items = kept
