"""The policies a replay can run, by name."""

from __future__ import annotations

from typing import Callable

from apcctl.lab.sim.policies.base import Ledger, Policy, Served
from apcctl.lab.sim.policies.lineage import LineagePolicy
from apcctl.lab.sim.policies.oracle import OraclePolicy
from apcctl.lab.sim.policies.periodic import PeriodicPolicy
from apcctl.lab.sim.policies.post_baseline import make_post_baseline
from apcctl.lab.sim.policies.seen import SeenOraclePolicy
from apcctl.lab.sim.policies.stock import make_stock
from apcctl.lab.sim.sizes import StateSizes
from server_patch.lineage import LineageConfig

# Each factory takes the state sizes and the lineage config (None: the policy's defaults).
FACTORIES: dict[str, Callable[[StateSizes, LineageConfig | None], Policy]] = {
    "lineage": lambda sizes, cfg: LineagePolicy(sizes, config=cfg),
    "lineage-nosegments": lambda sizes, cfg: LineagePolicy(sizes, segments=False, config=cfg),
    "lineage-nodrift": lambda sizes, cfg: LineagePolicy(sizes, drift=False, config=cfg),
    "stock": lambda sizes, cfg: make_stock(sizes),
    "post-baseline": lambda sizes, cfg: make_post_baseline(sizes),
    "periodic": lambda sizes, cfg: PeriodicPolicy(sizes),
    "oracle": lambda sizes, cfg: OraclePolicy(),
    "seen-oracle": lambda sizes, cfg: SeenOraclePolicy(),
}
POLICY_NAMES: tuple[str, ...] = tuple(FACTORIES)


def make_policy(name: str, sizes: StateSizes, lineage_config: LineageConfig | None = None) -> Policy:
    if name not in FACTORIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    return FACTORIES[name](sizes, lineage_config)


__all__ = ["FACTORIES", "POLICY_NAMES", "Ledger", "Policy", "Served", "make_policy"]
