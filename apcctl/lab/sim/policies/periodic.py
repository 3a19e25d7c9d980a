"""A Rapid-MLX-like design: KV in a prefix trie, recurrent checkpoints every 2048 tokens.

Model: a lineage is a stored prompt (its state at n - 1, the "final") plus recurrent checkpoints
at the multiples of 2048 its own prefill crossed. A request restores at the longest checkpoint
or final that is a prefix of it. A prompt that extends a lineage's final continues that lineage
(the old final is dropped: its state is superseded); anything else starts a new one. Each
lineage keeps at most 4 checkpoints, dropping the least recently used. KV rows are shared
through the trie, so held KV is the trie's token count; a new prompt copies only the rows the
trie lacks. Lineages are evicted LRU past the same 48 GB budget as lineage; no disk tier.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from apcctl.lab.sim.policies.base import Ledger, Served
from apcctl.lab.sim.prefix import PrefixSet
from apcctl.lab.sim.sizes import StateSizes
from apcctl.lab.sim.trace import Request
from server_patch.lineage.lookup import common_prefix_len
from server_patch.lineage.model import COLD, FINAL, PERIODIC, RAM

STRIDE = 2048
MAX_CHECKPOINTS = 4
RAM_BUDGET = 48 * (1 << 30)


@dataclass
class _Lineage:
    id: int
    final: np.ndarray  # tokens of the latest state (n - 1 of its latest prompt)
    last_used: float
    checkpoints: dict[int, float] = field(default_factory=dict)  # length -> last used


class PeriodicPolicy:
    name = "periodic"

    def __init__(self, sizes: StateSizes, *, stride: int = STRIDE,
                 max_checkpoints: int = MAX_CHECKPOINTS, ram_budget: int = RAM_BUDGET) -> None:
        self.sizes = sizes
        self.stride = stride
        self.max_checkpoints = max_checkpoints
        self.ram_budget = ram_budget
        self.ledger = Ledger()
        self.lineages: dict[int, _Lineage] = {}
        self._ids = itertools.count()
        self._trie_tokens = 0

    def serve(self, req: Request) -> Served:
        prompt, now = req.tokens, req.t
        final_len = req.n - 1
        owner, length, is_final = self._best(prompt, final_len)
        if owner is not None:
            owner.last_used = now
            if not is_final:
                owner.checkpoints[length] = now
        if owner is not None and is_final and length == final_len:
            return Served(length, "ram:final")  # identical resend: nothing new to store
        self._grow_trie(prompt[:final_len])
        if owner is not None and is_final:
            lineage = owner  # the prompt extends this lineage's latest state
            lineage.final = prompt[:final_len].copy()
        else:
            lineage = _Lineage(next(self._ids), prompt[:final_len].copy(), now)
            self.lineages[lineage.id] = lineage
        first = (length // self.stride + 1) * self.stride
        for point in range(first, final_len, self.stride):
            lineage.checkpoints[point] = now
        self._thin(lineage)
        self._enforce_budget(keep=lineage)
        source = COLD if owner is None else f"{RAM}:{FINAL if is_final else PERIODIC}"
        return Served(length, source)

    def _best(self, prompt: np.ndarray, limit: int) -> tuple[_Lineage | None, int, bool]:
        """(lineage, length, is its final) of the longest restore point, or (None, 0, False)."""
        best: tuple[_Lineage | None, int, bool] = (None, 0, False)
        for lineage in self.lineages.values():
            lcp = min(common_prefix_len(prompt, lineage.final), limit)
            final_len = lineage.final.shape[0]
            if final_len <= lcp and final_len > best[1]:
                best = (lineage, final_len, True)
                continue
            points = [p for p in lineage.checkpoints if p <= lcp]
            if points and max(points) > best[1]:
                best = (lineage, max(points), False)
        return best

    def _thin(self, lineage: _Lineage) -> None:
        while len(lineage.checkpoints) > self.max_checkpoints:
            victim = min(lineage.checkpoints, key=lambda p: (lineage.checkpoints[p], p))
            del lineage.checkpoints[victim]

    def _grow_trie(self, tokens: np.ndarray) -> None:
        """Rows the trie lacks are copied in; the rest are shared (call before storing ``tokens``)."""
        shared = max((common_prefix_len(tokens, x.final) for x in self.lineages.values()), default=0)
        added = tokens.shape[0] - shared
        self._trie_tokens += added
        self.ledger.bytes_cloned += self.sizes.kv_bytes(added)

    def _count_trie(self) -> int:
        """Distinct token positions over all finals: each adds what its longest shared prefix lacks."""
        seen, total = PrefixSet(), 0
        for lineage in sorted(self.lineages.values(), key=lambda x: -x.final.shape[0]):
            shared, _ = seen.longest(lineage.final)
            total += lineage.final.shape[0] - shared
            seen.add(lineage.final, lineage.id)
        return total

    def _enforce_budget(self, keep: _Lineage) -> None:
        while self.ram_bytes() > self.ram_budget and len(self.lineages) > 1:
            victim = min((x for x in self.lineages.values() if x is not keep),
                         key=lambda x: x.last_used)
            del self.lineages[victim.id]
            self.ledger.evictions += 1
            self._trie_tokens = self._count_trie()

    def finish(self, end_time: float) -> None:
        """Nothing is deferred."""

    def ram_bytes(self) -> int:
        states = sum(1 + len(x.checkpoints) for x in self.lineages.values())
        return self.sizes.kv_bytes(self._trie_tokens) + states * self.sizes.snapshot_bytes

    def disk_bytes(self) -> int:
        return 0

    def checkpoint_bytes(self) -> int:
        return sum(len(x.checkpoints) for x in self.lineages.values()) * self.sizes.snapshot_bytes
