"""The lineage cache policy: plain Python + numpy over sized state handles, no mlx-vlm import."""

from server_patch.lineage.config import LineageConfig
from server_patch.lineage.handles import KVHandle, SizedKV, SizedSnapshot, SnapshotHandle
from server_patch.lineage.model import (
    ANCHOR, CHECKPOINT_KINDS, COLD, DISK, DIVERGENCE, ENTRY, FINAL, GUARD, LOG_KINDS, PERIODIC, RAM,
    RESTORE_KINDS, SEGMENT, Capture, Checkpoint, DiskRecord, Entry, Event, EventKind, KVAdmission, Reason,
    RestoreKind, RestorePlan, Tier, as_tokens,
)
from server_patch.lineage.policy import CacheError, DiskTier, LineageCache

__all__ = [
    "ANCHOR", "CHECKPOINT_KINDS", "COLD", "DISK", "DIVERGENCE", "ENTRY", "FINAL", "GUARD", "LOG_KINDS",
    "PERIODIC", "RAM", "RESTORE_KINDS", "SEGMENT", "CacheError", "Capture", "Checkpoint",
    "DiskRecord", "DiskTier", "Entry", "Event", "EventKind", "KVAdmission", "KVHandle", "LineageCache",
    "LineageConfig", "Reason", "RestoreKind", "RestorePlan", "SizedKV", "SizedSnapshot", "SnapshotHandle",
    "Tier", "as_tokens",
]
