"""``apcctl report``: summarise a server's journal (a week of requests and cache events).

Reads the JSONL files ``server_patch.integration.journal`` writes, directly from disk: the
server need not run. Torn or foreign lines are skipped, never fatal.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Iterator

from apcctl.core.drift_view import drift_summary
from server_patch.integration.journal import journal_files
from server_patch.lineage.model import EventKind

PHASES = ("lookup", "admission", "prefill", "commit", "ttft")
CANCEL_PHASES = ("queued", "prefill", "decode")  # where a request's client went away
OUTCOME_FIELDS = ("outcome", "phase", "stored", "reply_tokens")  # what a request_outcome line sets
TIER_POINTS = 24  # rows of the bytes-per-tier table
_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """``30m``, ``12h``, ``7d``, ``2w`` (before now) or an ISO date/time -> a Unix time."""
    now = time.time() if now is None else now
    match = _SPAN.match(text)
    if match:
        return now - float(match.group(1)) * _UNIT_S[match.group(2)]
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ValueError(f"{text!r} is not a span (30m, 12h, 7d, 2w) or an ISO date") from None


def read_journal(directory: Path, since: float = 0.0, until: float = math.inf) -> Iterator[dict[str, Any]]:
    """Records with ``since <= time < until``, oldest file first."""
    for path in journal_files(Path(directory)):
        with path.open("rb") as f:
            for raw in f:
                try:
                    record = json.loads(raw)
                    at = float(record["time"])
                except (ValueError, KeyError, TypeError):
                    continue
                if since <= at < until:
                    yield record


def percentiles(values: list[float]) -> dict[str, float | None]:
    """Nearest-rank p50/p90/p99 and max; ``None`` for an empty list."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "max": ordered[-1]}


def summarize(records: Iterable[dict[str, Any]], *, since: float, until: float) -> dict[str, Any]:
    """The report as one JSON-ready dict (the CLI renders it, ``--json`` prints it)."""
    requests: list[dict[str, Any]] = []
    cache: list[dict[str, Any]] = []
    budgets: list[dict[str, Any]] = []
    starts = 0
    by_seq: dict[Any, dict[str, Any]] = {}  # this server run's request lines, for their outcome lines
    for record in records:
        kind = record.get("type")
        if kind == "request":
            requests.append(record)
            by_seq[record.get("seq")] = record
        elif kind == "request_outcome":
            _apply_outcome(by_seq.get(record.get("seq")), record)
        elif kind == "cache":
            cache.append(record)
        elif kind == "budgets":
            budgets.append(record)
        elif kind == "start":
            starts += 1
            by_seq.clear()  # sequence numbers restart with the server
    return {
        "window": {"since": since, "until": until, "server_starts": starts},
        "requests": _requests(requests),
        "latency_ms": {phase: percentiles([float(r.get(f"{phase}_ms", 0.0)) for r in requests if not _no_first_token(r)])
                       for phase in PHASES},
        "oracle": _oracle(requests),
        "drift": drift_summary(requests),  # what clients changed in their prompts (issue 37)
        "evictions": _evictions(cache),
        "disk": _disk(cache),
        "anchors": _anchors(cache, budgets),
        "tiers": _tiers(budgets),
    }


def _apply_outcome(request: dict[str, Any] | None, outcome: dict[str, Any]) -> None:
    """A request's final outcome, journaled after its line (cancelled in decode), onto that line."""
    if request is not None:
        request.update({k: outcome[k] for k in OUTCOME_FIELDS if k in outcome})


def _cancelled(record: dict[str, Any], phase: str) -> bool:
    return record.get("outcome") == "cancelled" and record.get("phase") == phase


def _no_first_token(record: dict[str, Any]) -> bool:
    """Cancelled while queued or in prefill: it has a record but no latencies to count."""
    return _cancelled(record, "queued") or _cancelled(record, "prefill")


def _requests(requests: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = defaultdict(lambda: {"requests": 0, "reused_tokens": 0, "prompt_tokens": 0})
    for r in requests:
        if _cancelled(r, "queued"):  # never reached a lookup: a request, not a restore kind (as in status)
            continue
        row = by_kind[str(r.get("restore_kind", "cold"))]
        row["requests"] += 1
        row["reused_tokens"] += int(r.get("restored_tokens", 0))
        row["prompt_tokens"] += int(r.get("prompt_tokens", 0))
    hits = sum(1 for r in requests if int(r.get("restored_tokens", 0)) > 0)
    prompt = sum(row["prompt_tokens"] for row in by_kind.values())
    reused = sum(row["reused_tokens"] for row in by_kind.values())
    return {"count": len(requests),
            **{f"cancelled_in_{phase}": sum(_cancelled(r, phase) for r in requests) for phase in CANCEL_PHASES},
            "hits": hits, "hit_rate": hits / len(requests) if requests else None,
            "prompt_tokens": prompt, "reused_tokens": reused,
            "token_hit_rate": reused / prompt if prompt else None,
            "by_kind": dict(sorted(by_kind.items()))}


def _oracle(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The live oracle over the window (``lineage.misses``): restored / oracle and the lost
    tokens by reason, from the request lines that carry an oracle (a server before issue 26
    journaled none: then no request counts)."""
    from server_patch.lineage.misses import summarize as oracle_summary

    counts: Counter[str] = Counter()
    for r in requests:
        if "oracle" not in r or _cancelled(r, "queued"):
            continue
        oracle = int(r.get("oracle", 0))
        counts.update({"requests": 1, "oracle_tokens": oracle,
                       "restored_tokens": min(int(r.get("restored_tokens", 0)), oracle)})
        counts.update({f"lost:{reason}": int(n) for reason, n in (r.get("lost") or {}).items()})
    return oracle_summary(counts)


def _evictions(cache: list[dict[str, Any]]) -> dict[str, Any]:
    evicts = [c for c in cache if c.get("event") == EventKind.EVICT]
    reasons = Counter(str(c.get("detail") or "-") for c in evicts)
    return {"count": len(evicts), "bytes": sum(int(c.get("bytes", 0)) for c in evicts),
            "by_reason": dict(reasons.most_common()),
            "disk_deletes": dict(Counter(str(c.get("detail") or "-") for c in cache
                                         if c.get("event") == "disk_delete").most_common())}


def _disk(cache: list[dict[str, Any]]) -> dict[str, Any]:
    writes = [c for c in cache if c.get("event") == "disk_write"]
    return {"writes": len(writes), "bytes_written": sum(int(c.get("bytes", 0)) for c in writes),
            "promotes": sum(1 for c in cache if c.get("event") == "promote"),
            "rejects": sum(1 for c in cache if c.get("event") == "disk_reject")}


def _anchors(cache: list[dict[str, Any]], budgets: list[dict[str, Any]]) -> dict[str, Any]:
    pins = [c for c in cache if c.get("event") == "pin"]
    return {"pinned": len(pins), "by_source": dict(Counter(str(c.get("detail") or "-") for c in pins)),
            "unpinned": sum(1 for c in cache if c.get("event") == "unpin"),
            "pinned_ids": sorted({str(c.get("entry_id")) for c in pins}),
            "pinned_now": _pinned(budgets[-1]) if budgets else None}


def _pinned(budgets: dict[str, Any]) -> int:
    """Pinned anchors wherever they are (``Budgets.pinned``): in RAM, or only on disk."""
    return int(budgets.get("anchor_count", 0)) + int(budgets.get("pinned_on_disk", 0))


def _tiers(budgets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes per tier over time: the largest value in each of up to ``TIER_POINTS`` time buckets."""
    if not budgets:
        return []
    first, last = float(budgets[0]["time"]), float(budgets[-1]["time"])
    width = max((last - first) / TIER_POINTS, 1e-9)
    buckets: dict[int, dict[str, Any]] = {}
    for b in budgets:
        index = min(TIER_POINTS - 1, int((float(b["time"]) - first) / width))
        row = buckets.setdefault(index, {"time": float(b["time"]), "ram_bytes": 0, "anchor_bytes": 0,
                                         "disk_bytes": 0, "entries": 0, "disk_files": 0})
        row["time"] = float(b["time"])
        for key, source in (("ram_bytes", "ram_used"), ("anchor_bytes", "anchor_bytes"),
                            ("disk_bytes", "disk_used"), ("entries", "entries"), ("disk_files", "disk_files")):
            row[key] = max(row[key], int(b.get(source, 0)))
    return [buckets[i] for i in sorted(buckets)]


def report(directory: Path, since: float, until: float | None = None) -> dict[str, Any]:
    """Read ``directory`` and summarise the window ``[since, until)``."""
    until = time.time() if until is None else until
    files = journal_files(Path(directory))
    summary = summarize(read_journal(directory, since, until), since=since, until=until)
    summary["window"].update({"journal": str(directory), "files": len(files)})
    return summary
