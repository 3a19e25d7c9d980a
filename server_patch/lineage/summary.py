"""The hit summary of a cache's counters, computed where the counters live.

``/admin/status`` serves it as ``lineage.hits``, so the CLI, the dashboard and scripts read one
answer instead of each decoding the ``hits_<kind>`` counters.
"""

from __future__ import annotations

from typing import Any, Mapping


def hit_summary(stats: Mapping[str, int]) -> dict[str, Any]:
    """Requests, restores (hits) and their rate, hits by restore kind, and the token reuse.

    ``by_kind`` counts every request by how it started (``cold`` included); ``token_hit_rate``
    is the share of prompt tokens restored rather than prefilled.
    """
    by_kind = {k[len("hits_"):]: int(v) for k, v in stats.items() if k.startswith("hits_")}
    hits = sum(v for k, v in by_kind.items() if k != "cold")
    total = hits + by_kind.get("cold", 0)
    reused, prefilled = int(stats.get("reused_tokens", 0)), int(stats.get("prefill_tokens", 0))
    return {"requests": total, "hits": hits, "hit_rate": hits / total if total else None, "by_kind": by_kind,
            "reused_tokens": reused, "prefill_tokens": prefilled,
            "token_hit_rate": reused / (reused + prefilled) if reused + prefilled else None}
