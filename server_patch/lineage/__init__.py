"""The lineage cache policy: plain Python + numpy over sized state handles, no mlx-vlm import.

The names below are loaded on first use (PEP 562), so a light submodule (``config``,
``summary``) is imported without numpy: ``apcctl`` reads them at start-up.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, typed for the checker (``__getattr__`` would make each Any)
    from server_patch.lineage.config import LineageConfig as LineageConfig
    from server_patch.lineage.handles import (
        KVHandle as KVHandle, SizedKV as SizedKV, SizedSnapshot as SizedSnapshot,
        SnapshotHandle as SnapshotHandle,
    )
    from server_patch.lineage.invariants import InvariantError as InvariantError
    from server_patch.lineage.model import (
        ANCHOR as ANCHOR, CHECKPOINT_KINDS as CHECKPOINT_KINDS, COLD as COLD, DISK as DISK,
        DIVERGENCE as DIVERGENCE, ENTRY as ENTRY, FINAL as FINAL, GUARD as GUARD, LOG_KINDS as LOG_KINDS,
        PERIODIC as PERIODIC, RAM as RAM, RESTORE_KINDS as RESTORE_KINDS, SEGMENT as SEGMENT,
        Capture as Capture, Checkpoint as Checkpoint, DiskRecord as DiskRecord, Entry as Entry,
        Event as Event, EventKind as EventKind, KVAdmission as KVAdmission, Loan as Loan, Reason as Reason,
        RestoreKind as RestoreKind, RestorePlan as RestorePlan, Tier as Tier, as_tokens as as_tokens,
    )
    from server_patch.lineage.policy import (
        CacheError as CacheError, DiskTier as DiskTier, LineageCache as LineageCache,
    )


_WHERE = {
    "LineageConfig": "config",
    **{name: "handles" for name in ("KVHandle", "SizedKV", "SizedSnapshot", "SnapshotHandle")},
    **{name: "model" for name in (
        "ANCHOR", "CHECKPOINT_KINDS", "COLD", "DISK", "DIVERGENCE", "ENTRY", "FINAL", "GUARD", "LOG_KINDS",
        "PERIODIC", "RAM", "RESTORE_KINDS", "SEGMENT", "Capture", "Checkpoint", "DiskRecord", "Entry", "Event",
        "EventKind", "KVAdmission", "Loan", "Reason", "RestoreKind", "RestorePlan", "Tier", "as_tokens")},
    **{name: "policy" for name in ("CacheError", "DiskTier", "LineageCache")},
    "InvariantError": "invariants",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
