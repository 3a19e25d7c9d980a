"""The replay loop: every request of a trace, in time order, through each policy.

Requests are served one at a time: a request sees everything that earlier requests committed
(real parallel requests may not, for every policy alike). Held bytes are sampled after each
request; the peak is the largest sample.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from apcctl.lab.sim.policies import Ledger, make_policy
from apcctl.lab.sim.sizes import StateSizes
from apcctl.lab.sim.trace import Request, Trace
from server_patch.lineage import LineageConfig


@dataclass
class PolicyRun:
    """One policy's outcome over one trace."""

    name: str
    prompt_lens: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    sources: Counter[str] = field(default_factory=Counter)
    ledger: Ledger = field(default_factory=Ledger)
    ram_peak: int = 0
    ram_end: int = 0
    disk_end: int = 0
    checkpoint_end: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def computed(self) -> list[int]:
        return [n - r for n, r in zip(self.prompt_lens, self.reused)]

    @property
    def prefill_tokens(self) -> int:
        return sum(self.computed)

    @property
    def reused_tokens(self) -> int:
        return sum(self.reused)

    def ttft(self, prefill_rate: float) -> np.ndarray:
        """Seconds to first token per request if prefill runs at ``prefill_rate`` tokens/s."""
        return np.asarray(self.computed, dtype=np.float64) / prefill_rate


def replay_policy(name: str, requests: list[Request], sizes: StateSizes,
                  lineage_config: LineageConfig | None = None) -> PolicyRun:
    policy = make_policy(name, sizes, lineage_config)
    run = PolicyRun(name)
    started = time.perf_counter()
    for req in requests:
        served = policy.serve(req)
        if not 0 <= served.reused < max(1, req.n):
            raise AssertionError(f"{name} reused {served.reused} of {req.n} tokens (request {req.index})")
        run.prompt_lens.append(req.n)
        run.reused.append(served.reused)
        run.sources[served.source] += 1
        run.ram_peak = max(run.ram_peak, policy.ram_bytes())
    policy.finish(requests[-1].t if requests else 0.0)
    run.wall_s = time.perf_counter() - started
    run.ledger = policy.ledger
    run.ram_end = policy.ram_bytes()
    run.ram_peak = max(run.ram_peak, run.ram_end)
    run.disk_end = policy.disk_bytes()
    run.checkpoint_end = policy.checkpoint_bytes()
    stats = getattr(policy, "stats", None)
    if callable(stats):
        run.extra["stats"] = stats()
    return run


def replay(trace: Trace, policies: Iterable[str], sizes: StateSizes,
           lineage_config: LineageConfig | None = None) -> list[PolicyRun]:
    requests = trace.in_time_order()
    return [replay_policy(name, requests, sizes, lineage_config) for name in policies]
