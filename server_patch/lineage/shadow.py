"""What each namespace processed, as prefix hashes of small token blocks: the live oracle.

A ratio of restored tokens cannot say whether it is good; the shadow index says what an
unbounded cache would have restored on the same traffic. It keeps no token text and no state:
one 64-bit hash per block of ``block`` tokens, the hash of the whole prefix up to that block's
end (so equal hashes mean equal prefixes), with the namespaces that sent it. A prompt's oracle
is the longest prefix it shares with anything processed before in its namespace, capped at its
length minus one (the last prompt token is always computed), rounded down to the block.

Bounded by its own byte budget, evicted oldest-first. A chain is touched last block first, so
a prefix is always newer than its extensions and eviction takes extensions first: the blocks
a namespace holds stay prefix-closed and the longest match is a binary search.

The hash is a statistic, not a proof (it decides no restore): a multiply-and-mix per block,
summed over positions, vectorised in numpy (under a millisecond for 100k tokens).

Plain Python + numpy, no mlx: the server and the simulator share it.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from server_patch.lineage.model import as_tokens

BLOCK_TOKENS = 16
# What one held block costs in CPython (an ordered dict slot, its link node, the int key),
# measured with tracemalloc (tests/lineage/test_lineage_shadow.py); a second namespace on the same
# block adds a small frozenset.
BYTES_PER_BLOCK = 128
BYTES_PER_EXTRA_TAG = 216

_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SEED = 0x5EED_0A11  # fixed: a journal's hash sequence means the same after a restart


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (wrapping uint64 arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def _weights(block: int) -> np.ndarray:
    rng = np.random.default_rng(_SEED + block)
    return rng.integers(1, 1 << 63, size=block, dtype=np.uint64) | np.uint64(1)


def block_hashes(tokens: Sequence[int] | np.ndarray, block: int = BLOCK_TOKENS) -> np.ndarray:
    """One uint64 per full block: ``out[i]`` hashes ``tokens[:(i + 1) * block]``."""
    ids = as_tokens(tokens)
    count = int(ids.shape[0]) // block
    if count == 0:
        return np.zeros(0, dtype=np.uint64)
    grid = ids[: count * block].astype(np.uint64).reshape(count, block)
    with np.errstate(over="ignore"):
        per_block = (grid * _weights(block)).sum(axis=1, dtype=np.uint64)
        positioned = _mix(per_block ^ (np.arange(count, dtype=np.uint64) * _GOLDEN))
        return _mix(np.cumsum(positioned, dtype=np.uint64))


@dataclass(frozen=True)
class Match:
    """A prompt against the shadow: its oracle, and whether another namespace shares more."""

    oracle: int  # tokens: the longest prefix seen in its namespace, capped and block-rounded
    elsewhere: bool = False  # another namespace processed a longer prefix (counted, never shown)


class ShadowIndex:
    """Prefix-block hashes of everything each namespace processed, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int, block: int = BLOCK_TOKENS) -> None:
        if block < 1:
            raise ValueError(f"shadow block must be >= 1 token, got {block}")
        self.budget_bytes = max(0, int(budget_bytes))
        self.block = int(block)
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, str | frozenset[str]] = OrderedDict()  # hash -> namespace(s)
        self._extra_tags = 0
        self.evicted_blocks = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def nbytes(self) -> int:
        """What the index holds, as accounted against its budget."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        return len(self._blocks) * BYTES_PER_BLOCK + self._extra_tags * BYTES_PER_EXTRA_TAG

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def hashes(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        return block_hashes(tokens, self.block)

    def match(self, hashes: np.ndarray, namespace: str, prompt_len: int) -> Match:
        """The oracle of a prompt with these block hashes (see the module docstring)."""
        cap = max(0, prompt_len - 1) // self.block
        usable = [int(h) for h in hashes[:cap]]
        with self._lock:
            own = self._longest(usable, lambda tags: _has(tags, namespace))
            anyone = self._longest(usable, lambda tags: True)
        return Match(own * self.block, elsewhere=anyone > own)

    def _longest(self, hashes: list[int], accept: Callable[[str | frozenset[str]], bool]) -> int:
        """Blocks matched: the largest ``k`` with ``hashes[k - 1]`` held and accepted (the
        held blocks are prefix-closed, so a binary search finds it)."""
        lo, hi = 0, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            tags = self._blocks.get(hashes[mid - 1])
            if tags is not None and accept(tags):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, hashes: np.ndarray, namespace: str) -> None:
        """``namespace`` processed the prefix these hashes name: touch it, last block first."""
        if not self.enabled or not len(hashes):
            return
        name = sys.intern(namespace)
        with self._lock:
            for value in reversed(hashes.tolist()):
                tags = self._blocks.get(value)
                if tags is None:
                    self._blocks[value] = name
                    continue
                if not _has(tags, name):
                    self._blocks[value] = frozenset({*_names(tags), name})
                    self._extra_tags += 1
                self._blocks.move_to_end(value)
            self._evict()

    def add_older(self, hashes: np.ndarray, namespace: str) -> bool:
        """``namespace`` processed this prefix before everything held (the journal, read at
        start): its new blocks go in as the oldest, prefix last, and never push anything out.
        False once the budget is full (the rest is not taken)."""
        if not self.enabled:
            return False
        name = sys.intern(namespace)
        with self._lock:
            for value in hashes.tolist():  # each to the very front: the prefix ends up newest
                tags = self._blocks.get(value)
                if tags is not None and _has(tags, name):
                    continue
                cost = BYTES_PER_BLOCK if tags is None else BYTES_PER_EXTRA_TAG
                if self._nbytes() + cost > self.budget_bytes:
                    return False
                if tags is None:
                    self._blocks[value] = name
                    self._blocks.move_to_end(value, last=False)
                else:  # held already (newer): only the namespace is added, where it is
                    self._blocks[value] = frozenset({*_names(tags), name})
                    self._extra_tags += 1
            return True

    def _evict(self) -> None:
        while self._blocks and self._nbytes() > self.budget_bytes:
            _, tags = self._blocks.popitem(last=False)
            self._extra_tags -= len(_names(tags)) - 1
            self.evicted_blocks += 1

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._extra_tags = 0


def _names(tags: str | frozenset[str]) -> frozenset[str] | tuple[str]:
    return (tags,) if isinstance(tags, str) else tags


def _has(tags: str | frozenset[str], namespace: str) -> bool:
    return tags == namespace if isinstance(tags, str) else namespace in tags


__all__ = ["BLOCK_TOKENS", "BYTES_PER_BLOCK", "Match", "ShadowIndex", "block_hashes"]
