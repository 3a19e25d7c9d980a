"""mlx-vlm's own APC figures (``GET /metrics``' ``server.apc``, ``GET /v1/cache/stats``), filled
from the lineage cache where it serves the model.

Behind a lineage cache, stock's ``APCManager`` sees no lookup of its own: its counters stay at 0
(``token_hit_rate: 0.0`` while the lineage cache restores 98 % of prompt tokens). Its
``stats_snapshot`` (the overlay's ``stock_stats`` topic, through the door) answers these fields
from the lineage cache's counters and budgets instead, says so in ``source``, and names where the
full figures are (``lineage``: the hit summary; ``/admin/status`` and ``/admin/metrics``). Only
the content of the ``apc`` fields changes: who may read ``/metrics`` is the traffic guard's
business. A block-mode model (no lineage cache) keeps stock's figures untouched.
"""

from __future__ import annotations

from typing import Any

from server_patch.lineage.model import COLD, DISK
from server_patch.lineage.summary import hit_summary

SOURCE = "apc_lineage"
WHERE = "/admin/status (hits, budgets) and /admin/metrics (Prometheus), with the admin token"


def lineage_figures(runtime: Any, stock: dict[str, Any]) -> dict[str, Any]:
    """``stock`` (``APCManager.stats_snapshot()``) with its counters read from ``runtime``'s cache."""
    cache = runtime.cache
    stats = dict(cache.stats)
    hits = hit_summary(stats)
    budgets = cache.budgets()
    reused = hits["reused_tokens"]
    figures = {
        "lookups_hit": hits["hits"],
        "lookups_miss": hits["by_kind"].get(COLD, 0),
        "matched_tokens": reused,
        "restored_tokens": reused,
        "stored_tokens": hits["prefill_tokens"],  # stock's denominator: prompt tokens computed
        "token_hit_rate": hits["token_hit_rate"] or 0.0,
        "evictions": int(stats.get("evictions", 0)),
        "stores": int(stats.get("stores", 0)),
        "disk_hits": hits["by_kind"].get(DISK, 0),
        "disk_writes": int(stats.get("disk_writes", 0)),
        "resident_bytes": budgets["ram_used"],
        "memory_max_bytes": budgets["ram_limit"],
    }
    if runtime.disk is not None:
        figures.update(disk_bytes=budgets["disk_used"], disk_max_bytes=budgets["disk_limit"],
                       disk_files=budgets["disk_files"], disk_evictions=int(stats.get("disk_evictions", 0)))
    return {**stock, **figures, "source": SOURCE, "lineage": {**hits, "see": WHERE}}


__all__ = ["SOURCE", "WHERE", "lineage_figures"]
