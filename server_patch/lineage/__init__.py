"""The lineage cache policy: plain Python + numpy over sized state handles, no mlx-vlm import.

The names below are loaded on first use (PEP 562), so a light submodule (``config``,
``summary``) is imported without numpy: ``apcctl`` reads them at start-up.
"""

from __future__ import annotations

import importlib
from typing import Any

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
