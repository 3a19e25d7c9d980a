"""JSON shapes of the admin endpoint: what an operator sees of entries, anchors and events."""

from __future__ import annotations

from typing import Any

from server_patch.lineage import DiskRecord, Entry, Event


def checkpoint_view(entry: Entry) -> list[dict[str, Any]]:
    return [{"length": c.length, "kind": c.kind, "bytes": c.nbytes, "created": c.created,
             "last_hit": c.last_hit, "hits": c.hits} for c in entry.checkpoints]


def entry_view(entry: Entry, record: DiskRecord | None = None) -> dict[str, Any]:
    """One lineage entry or anchor held in RAM (and maybe on disk too)."""
    return {
        "id": entry.id,
        "kind": "anchor" if entry.is_anchor else "conversation",
        "pinned": entry.pinned,
        "length": entry.length,
        "bytes": entry.nbytes,
        "kv_bytes": int(entry.kv.nbytes),
        "kv_buffer_bytes": int(getattr(entry.kv, "held_nbytes", entry.kv.nbytes)),
        "checkpoint_bytes": entry.checkpoint_bytes,
        "created": entry.created,
        "last_used": entry.last_used,
        "last_hit": entry.last_hit,
        "hits": entry.hits,
        "tier": "ram+disk" if record is not None else "ram",
        "disk_bytes": record.nbytes if record is not None else 0,
        "label": entry.label,
        "namespace": entry.namespace,
        "checkpoints": checkpoint_view(entry),
    }


def record_view(record: DiskRecord) -> dict[str, Any]:
    """An entry that lives only on disk (its header is all RAM knows of it)."""
    return {
        "id": record.id,
        "kind": "anchor" if record.is_anchor else "conversation",
        "pinned": record.pinned,
        "length": record.length,
        "bytes": 0,
        "kv_bytes": 0,
        "checkpoint_bytes": 0,
        "created": None,
        "last_used": record.last_used,
        "last_hit": None,
        "hits": 0,
        "tier": "disk",
        "disk_bytes": record.nbytes,
        "label": record.label,
        "namespace": record.namespace,
        "checkpoints": [{"length": n, "kind": k, "bytes": None, "created": None, "last_hit": None,
                         "hits": 0} for n, k in record.checkpoints],
    }


def event_view(seq: int, at: float, event: Event) -> dict[str, Any]:
    return {"seq": seq, "time": at, "type": "cache", "event": event.kind, "entry_id": event.entry_id,
            "length": event.length, "bytes": event.nbytes, "detail": event.detail}
