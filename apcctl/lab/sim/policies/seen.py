"""The bound with reply reuse: every earlier prompt's state, and every earlier prompt + its reply.

Like ``oracle``, but a finished request also leaves the state after its generated reply (the
tokens the model was fed), so a next prompt that re-renders the reply verbatim can restore past
it. On a trace without ``reply`` fields it equals ``oracle``.
"""

from __future__ import annotations

from apcctl.lab.sim.policies.oracle import OraclePolicy
from apcctl.lab.sim.policies.base import Served
from apcctl.lab.sim.trace import Request
from server_patch.lineage.model import COLD


class SeenOraclePolicy(OraclePolicy):
    name = "seen-oracle"

    def serve(self, req: Request) -> Served:
        seen = self._seen[req.namespace]
        shared, _ = seen.longest(req.tokens)
        seen.add(req.seen, req.index)  # covers req.tokens too: a prefix of it
        reused = min(shared, req.n - 1)
        return Served(reused, "any" if reused else COLD)
