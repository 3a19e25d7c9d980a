"""The bound: unbounded memory, every earlier prompt's state at every length.

Reuses the longest prefix the request shares with any earlier prompt (in the same namespace),
capped at n - 1. It stores nothing real, so it reports no bytes.
"""

from __future__ import annotations

from collections import defaultdict

from apcctl.lab.sim.policies.base import Ledger, Served
from apcctl.lab.sim.prefix import PrefixSet
from apcctl.lab.sim.trace import Request
from server_patch.lineage.model import COLD


class OraclePolicy:
    name = "oracle"

    def __init__(self) -> None:
        self.ledger = Ledger()
        self._seen: defaultdict[str, PrefixSet] = defaultdict(PrefixSet)

    def serve(self, req: Request) -> Served:
        seen = self._seen[req.namespace]
        shared, _ = seen.longest(req.tokens)
        seen.add(req.tokens, req.index)
        reused = min(shared, req.n - 1)
        return Served(reused, "any" if reused else COLD)

    def finish(self, end_time: float) -> None:
        """Nothing to do."""

    def ram_bytes(self) -> int:
        return 0

    def disk_bytes(self) -> int:
        return 0

    def checkpoint_bytes(self) -> int:
        return 0
