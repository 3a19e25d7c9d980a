"""Where the victim's worst gap went (issue 40): the patched server's own split of the victim
stream's inter-token gaps, read from its request record (``/admin/requests``: ``worst_gap``,
``gaps``), next to the gaps its client measured.

Each gap the server records is split into named parts that add up to it (``integration.waits``):
the victim's own share of the joint decode ``step``, the other session's work by kind (``prefill``
chunks, ``restore``, ``join``, ``leave``, ``commit``, ``load``, ``stage``, ``pool``) and what no
unit timed (``unattributed``: the loop, the server's queues). The server measures a gap between
two of its decode steps; the client's gap adds the socket and the client's own scheduling.
"""

from __future__ import annotations

import time
from typing import Any

from apcctl.lab.bench.ttft import BenchServer

RECORD_WAIT_S = 30.0  # the victim's row ends right after its last token; its record is final then
POLL_S = 0.2


def victim_gaps(server: BenchServer, min_gaps: int, older: int = 0) -> dict[str, Any] | None:
    """The newest request record with at least ``min_gaps`` gaps (the victim's stream with the
    event: the event's own requests reply a few tokens), once its row ended; ``older``: that
    many such records before it (1: the victim's stream alone, just before). None from stock or
    from a server whose records carry no gaps (an older tree's, under ``--against``)."""
    if not server.patched:
        return None
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        records = server.get_json("/admin/requests?limit=5000").get("requests", [])
        if records and not any("gap_count" in r for r in records):
            return None  # a server older than the split (``bench --against``) never records gaps
        victims = sorted((r for r in records if int(r.get("gap_count") or 0) >= min_gaps), key=lambda r: -r["seq"])
        newest = victims[older] if len(victims) > older else None
        if (newest is not None and newest.get("ended")) or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    if newest is None:
        return None
    return {"worst_gap": newest.get("worst_gap") or {}, "gaps": newest.get("gaps") or [],
            "gap_count": newest.get("gap_count", 0), "waited": newest.get("waited") or {},
            "ended": bool(newest.get("ended"))}


def parts_text(gap: dict[str, Any], limit: int = 5) -> str:
    """"734 ms: join 420, prefill 200, step 100, unattributed 14" (the largest parts first)."""
    shown = largest(gap.get("parts") or {}, limit)
    return f"{gap.get('ms', 0):,.0f} ms: {shown}" if shown else ""


def largest(parts: dict[str, float], limit: int = 5) -> str:
    """"join 420, prefill 200, step 100" (the ``limit`` largest of ``parts``, whatever their names)."""
    kept = sorted(((part, ms) for part, ms in parts.items() if abs(ms) >= 0.5), key=lambda kv: -abs(kv[1]))
    return ", ".join(f"{part} {ms:,.0f}" for part, ms in kept[:limit])


__all__ = ["largest", "parts_text", "victim_gaps"]
