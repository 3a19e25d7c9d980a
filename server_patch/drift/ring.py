"""A few recent sequences per namespace, and the nearest one to a new prompt.

Bounded: at most ``per_namespace`` sequences in each namespace (newest kept), at most
``namespaces`` namespaces (least recently seen dropped) and ``max_tokens`` tokens in all.
A lookup compares block hashes (``lineage.shadow.block_hashes``: equal hashes, equal
prefixes), then exact tokens only inside the first block that differs, so its cost is a
vector compare per held sequence. Never across namespaces: a namespace sees only its own.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from server_patch.lineage.shadow import BLOCK_TOKENS, block_hashes


@dataclass(frozen=True)
class Seen:
    """One earlier sequence of a namespace: a prompt, or a prompt and the reply fed after it."""

    tokens: np.ndarray
    hashes: np.ndarray
    kinds: Mapping[int, str] = field(default_factory=dict)  # its segment boundaries, by kind
    gen_start: int | None = None  # where its generation prompt starts (a prompt's; None: unknown)
    reply_from: int = 0  # a reply sequence: where the reply starts (0: a prompt)
    seq: int = 0

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens ``a`` and ``b`` share from the start (exact)."""
    n = min(int(a.shape[0]), int(b.shape[0]))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def shared_prefix(seen: Seen, tokens: np.ndarray, hashes: np.ndarray, block: int) -> int:
    """Tokens ``tokens`` shares with ``seen``: equal blocks by hash, then the first unequal
    block token by token."""
    n = min(len(seen.hashes), len(hashes))
    differ = np.flatnonzero(seen.hashes[:n] != hashes[:n])
    blocks = int(differ[0]) if differ.size else n
    start = blocks * block
    stop = min(seen.length, int(tokens.shape[0]), start + block)
    return start + common_prefix(seen.tokens[start:stop], tokens[start:stop])


class RecentPrompts:
    """The recent sequences of each namespace (see the module docstring). Thread-safe."""

    def __init__(self, per_namespace: int = 8, namespaces: int = 256, max_tokens: int = 4 << 20,
                 block: int = BLOCK_TOKENS) -> None:
        self.per_namespace = max(1, per_namespace)
        self.namespaces = max(1, namespaces)
        self.max_tokens = max(1, max_tokens)
        self.block = block
        self._lock = threading.Lock()
        self._rings: OrderedDict[str, deque[Seen]] = OrderedDict()
        self._tokens = 0
        self._seq = itertools.count(1)

    @property
    def tokens(self) -> int:
        return self._tokens

    def hashes(self, tokens: np.ndarray) -> np.ndarray:
        return block_hashes(tokens, self.block)

    def nearest(self, tokens: np.ndarray, namespace: str, hashes: np.ndarray | None = None) -> tuple[Seen | None, int]:
        """The held sequence of ``namespace`` sharing the longest prefix with ``tokens`` (the
        newest on a tie: its own lineage's last turn), and that prefix's length."""
        hashes = self.hashes(tokens) if hashes is None else hashes
        with self._lock:
            held = list(self._rings.get(namespace, ()))
        best, best_len = None, -1
        for seen in reversed(held):
            shared = shared_prefix(seen, tokens, hashes, self.block)
            if shared > best_len:
                best, best_len = seen, shared
        return best, max(0, best_len)

    def add(self, tokens: np.ndarray, namespace: str, *, hashes: np.ndarray | None = None,
            kinds: Mapping[int, str] | None = None, gen_start: int | None = None, reply_from: int = 0) -> Seen:
        """Hold ``tokens`` as the namespace's newest sequence. A sequence that merely extends
        one held (a prompt and its reply) replaces it."""
        tokens = np.asarray(tokens)
        length = int(tokens.shape[0])
        with self._lock:
            ring = self._rings.pop(namespace, None) or deque()
            self._rings[namespace] = ring
            for old in list(ring):
                if old.length <= length and common_prefix(old.tokens, tokens) == old.length:
                    ring.remove(old)
                    self._tokens -= old.length
                    if gen_start is None and old.gen_start is not None:  # a prompt's, kept by its reply
                        gen_start = old.gen_start
                        kinds = kinds or old.kinds
            seen = Seen(tokens, self.hashes(tokens) if hashes is None else hashes, dict(kinds or {}), gen_start,
                        reply_from, next(self._seq))
            ring.append(seen)
            self._tokens += seen.length
            while len(ring) > self.per_namespace:
                self._tokens -= ring.popleft().length
            while len(self._rings) > self.namespaces or (self._tokens > self.max_tokens and len(self._rings) > 1):
                _, dropped = self._rings.popitem(last=False)
                self._tokens -= sum(s.length for s in dropped)
            while self._tokens > self.max_tokens and len(ring) > 1:
                self._tokens -= ring.popleft().length
        return seen

    def clear(self) -> None:
        with self._lock:
            self._rings.clear()
            self._tokens = 0


__all__ = ["RecentPrompts", "Seen", "common_prefix", "shared_prefix"]
