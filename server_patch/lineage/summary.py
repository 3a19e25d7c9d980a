"""The hit summary of a cache's counters, computed where the counters live.

``/admin/status`` serves it as ``hits`` (zeros before the cache starts), so the CLI, the dashboard and scripts read one
answer instead of each decoding the ``hits_<kind>`` counters.
"""

from __future__ import annotations

from typing import Any, Mapping

from server_patch.lineage.model import COLD, KVAdmission

HITS_PREFIX = "hits_"  # + a log kind (``RestorePlan.log_kind``): requests that started there
DISK_POINT_PREFIX = "disk_point_"  # + a ``RestoreKind``: disk restores by the point their plan restored
KV_PREFIX = "kv_"  # + a ``KVAdmission``: warm requests by how their KV reached the batch
CANCELLED_QUEUED = "cancelled_queued"  # requests cancelled while queued: they never reached a lookup


def hits_key(kind: str) -> str:
    """The stats key counting requests of log kind ``kind``."""
    return HITS_PREFIX + kind


def disk_point_key(kind: str) -> str:
    """The stats key counting disk restores (log kind ``disk``) whose plan restored a ``kind`` point."""
    return DISK_POINT_PREFIX + kind


def disk_by_point(stats: Mapping[str, int]) -> dict[str, int]:
    """Disk restores by the kind of point their plan restored (entry, anchor, a checkpoint kind)."""
    return _by_suffix(stats, DISK_POINT_PREFIX, ())


def kv_key(mode: str) -> str:
    """The stats key counting warm requests admitted by ``mode``."""
    return KV_PREFIX + mode


def _by_suffix(stats: Mapping[str, int], prefix: str, known: tuple[str, ...]) -> dict[str, int]:
    """``{suffix: count}`` of the keys starting with ``prefix``: every ``known`` one (0 if
    never counted) first, then any other found."""
    found = {k[len(prefix):]: int(v) for k, v in stats.items() if k.startswith(prefix)}
    return {**{name: found.get(name, 0) for name in known}, **found}


def hits_by_kind(stats: Mapping[str, int], *, known: tuple[str, ...] = ()) -> dict[str, int]:
    """Requests by log kind, read back from the ``hits_<kind>`` keys (``known``: listed even at 0)."""
    return _by_suffix(stats, HITS_PREFIX, known)


def kv_by_mode(stats: Mapping[str, int]) -> dict[str, int]:
    """Warm requests by admission mode, every ``KVAdmission`` listed (0 if never counted)."""
    return _by_suffix(stats, KV_PREFIX, tuple(KVAdmission))


def hit_summary(stats: Mapping[str, int]) -> dict[str, Any]:
    """Requests, restores (hits) and their rate, hits by restore kind, and the token reuse.

    ``by_kind`` counts every request that reached a lookup by how it started (``cold``
    included); ``requests`` adds those cancelled while queued (``cancelled_queued``), so it
    equals the number of request records; ``token_hit_rate`` is the share of prompt tokens
    restored rather than prefilled.
    """
    by_kind = hits_by_kind(stats)
    hits = sum(v for k, v in by_kind.items() if k != COLD)
    queued = int(stats.get(CANCELLED_QUEUED, 0))
    total = hits + by_kind.get(COLD, 0) + queued
    reused, prefilled = int(stats.get("reused_tokens", 0)), int(stats.get("prefill_tokens", 0))
    return {"requests": total, "hits": hits, "hit_rate": hits / total if total else None, "by_kind": by_kind,
            "disk_by_point": disk_by_point(stats), "cancelled_queued": queued,
            "reused_tokens": reused, "prefill_tokens": prefilled,
            "token_hit_rate": reused / (reused + prefilled) if reused + prefilled else None}


__all__ = ["CANCELLED_QUEUED", "DISK_POINT_PREFIX", "HITS_PREFIX", "KV_PREFIX", "disk_by_point", "disk_point_key", "hit_summary", "hits_by_kind", "hits_key", "kv_by_mode", "kv_key"]
