"""The lineage cache's records: entries, checkpoints, disk records, restore plans, events.

Plain data. The policy (``policy.py``) decides; these only describe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Iterator

import numpy as np

from server_patch.lineage.handles import KVHandle, SnapshotHandle

class RestoreKind(StrEnum):
    """Where a restore starts, and what a capture is for (the values are what stats keys,
    logs, the admin and disk files show)."""

    # Checkpoint kinds: a recurrent state at an earlier length sharing the entry's KV rows.
    GUARD = "guard"
    FINAL = "final"
    DIVERGENCE = "divergence"
    PERIODIC = "periodic"
    SEGMENT = "segment"
    # Or one of these.
    ENTRY = "entry"  # the entry's own latest state
    ANCHOR = "anchor"  # a pinned system-prompt-and-tools entry
    COLD = "cold"


class Tier(StrEnum):
    """Where a restore point is stored; a disk hit's log kind is ``DISK`` too."""

    RAM = "ram"
    DISK = "disk"


class KVAdmission(StrEnum):
    """How a restored entry's KV reached the batch (the ``kv_<mode>`` stats keys)."""

    LENT = "lent"  # the entry's own buffer, no copy
    COPIED = "copied"  # one merge copy
    STAGED = "staged"  # one copy, made off the generation thread while it queued (``integration.staging``)


class EventKind(StrEnum):
    """What a cache ``Event`` records (the admin event stream and the journal show the value)."""

    STORE = "store"
    ABSORB = "absorb"
    CHECKPOINT = "checkpoint"
    THIN = "thin"
    EVICT = "evict"
    PIN = "pin"
    UNPIN = "unpin"
    PROMOTE = "promote"
    REWIND = "rewind"
    DISK_WRITE = "disk_write"
    DISK_WRITE_FAILED = "disk_write_failed"
    DISK_DELETE = "disk_delete"
    DISK_REJECT = "disk_reject"


class Reason(StrEnum):
    """Why an entry or a file went, or an anchor was pinned (an ``Event``'s ``detail``)."""

    OPERATOR = "operator"  # an admin verb
    RESTART_PROBE = "restart probe"  # apcctl restart removing the anchor it pinned to probe the restart
    CAPTURED = "captured"  # an anchor pinned by a capture
    ANCHOR_CAP = "anchor cap"
    RAM_BUDGET = "ram budget"
    DISK_CAP = "disk cap"
    SUPERSEDED = "superseded"  # a file whose entry's newer file replaces it
    RESET = "reset"  # /v1/cache/reset
    FAILED_VALIDATION = "failed validation"
    PROMPT_END = "prompt end"  # a rewind's target
    LENT_ROWS_LOST = "lent rows lost"  # a loan that could not hand its rows back
    UNWRITTEN = "unwritten"  # suffix of an eviction reason: the disk lacks the state


GUARD, FINAL, DIVERGENCE, PERIODIC, SEGMENT = (RestoreKind.GUARD, RestoreKind.FINAL, RestoreKind.DIVERGENCE,
                                              RestoreKind.PERIODIC, RestoreKind.SEGMENT)
ENTRY, ANCHOR, COLD = RestoreKind.ENTRY, RestoreKind.ANCHOR, RestoreKind.COLD
CHECKPOINT_KINDS = (GUARD, FINAL, DIVERGENCE, PERIODIC, SEGMENT)
RESTORE_KINDS = (ENTRY, ANCHOR, *CHECKPOINT_KINDS, COLD)
RAM, DISK = Tier.RAM, Tier.DISK
# What a request's log and the ``hits_<kind>`` stats name it by: its restore kind, or ``disk``.
LOG_KINDS = (*RESTORE_KINDS, DISK)


def as_tokens(tokens: Any) -> np.ndarray:
    """Token ids as a contiguous int32 array, the form every comparison uses."""
    return np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(-1))


@dataclass
class Checkpoint:
    """The snapshot layers' state at ``length`` tokens; the KV rows come from the entry."""

    length: int
    kind: str
    state: SnapshotHandle
    created: float
    last_hit: float | None = None
    hits: int = 0
    # A FINAL point at the end of a generated reply (an absorbed head that sat past its reply,
    # reply reuse): thinned before every other class. Kept on disk (``reply_ends``).
    reply_end: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.state.nbytes)


@dataclass
class Entry:
    """One conversation lineage (or one anchor): its latest state plus earlier checkpoints."""

    id: str
    tokens: np.ndarray
    kv: KVHandle
    head: SnapshotHandle
    namespace: str
    created: float
    last_used: float
    is_anchor: bool = False
    pinned: bool = False
    checkpoints: list[Checkpoint] = field(default_factory=list)
    hits: int = 0
    last_hit: float | None = None
    label: str = ""
    # Disk bookkeeping: ``dirty`` means RAM holds something the disk file lacks.
    on_disk: bool = False
    dirty: bool = True
    supersedes: list[str] = field(default_factory=list)
    # With reply reuse the head sits past the reply; this is the newest turn's prompt end
    # (a FINAL checkpoint thinning never drops). 0: the head is the prompt end itself.
    prompt_end: int = 0
    # The newest turn's points (``LineageCache._turn_points``): where it restored, its periodic
    # point and the start of its last message. While it is the newest turn thinning keeps the
    # longest checkpoint at or below each (counted in the cap, but for a reply end): where a next
    # prompt that drops, edits or follows the last message (an abort, user after user, aider's
    # moving reminder) restores. Not kept on disk: a restarted entry thins as before.
    turn_points: frozenset[int] = frozenset()
    # Loan receipts out on its KV rows (``LineageCache.lend``/``end``: holds of kind ``LENT``,
    # ``lineage.holds``, counted here as SGLang counts ``lock_ref``, for readers; the invariants
    # check the count against the holds): while any is out the entry is not evictable, writable
    # nor rewindable.
    loans: int = 0

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held: the KV once (its whole buffers where a handle knows them, spare rows
        included), the head state, and every checkpoint's state."""
        return int(self.kv.held_nbytes) + int(self.head.nbytes) + self.checkpoint_bytes

    @property
    def lent(self) -> bool:
        """A loan receipt is out on its KV rows (the running request that extends them): not
        evictable, writable nor rewindable until the loan ends (or the borrower's entry absorbs it)."""
        return self.loans > 0

    @property
    def checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self.checkpoints)

    def restore_points(self) -> Iterator[tuple[int, str, Checkpoint | None]]:
        """(length, kind, checkpoint or None for the head), longest first."""
        yield self.length, (ANCHOR if self.is_anchor else ENTRY), None
        for cp in sorted(self.checkpoints, key=lambda c: -c.length):
            yield cp.length, cp.kind, cp


@dataclass(eq=False)
class Loan:
    """A receipt for an entry's KV rows lent to one request (``LineageCache.lend``): a hold of
    kind ``LENT`` (``lineage.holds``), its ``owner``'s until ``LineageCache.end`` or
    ``release(owner)``; each receipt ends once."""

    entry: Entry
    length: int  # the rows lent: the entry's length when it was lent
    ended: bool = False
    owner: Any = None  # who holds it (``LineageCache.lend``'s owner, or the receipt itself)


@dataclass
class DiskRecord:
    """What the disk index knows about one file, read from its header alone."""

    id: str
    tokens: np.ndarray
    namespace: str
    checkpoints: tuple[tuple[int, str], ...]
    nbytes: int
    last_used: float
    is_anchor: bool = False
    pinned: bool = False
    label: str = ""

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    def restore_points(self) -> Iterator[tuple[int, str]]:
        yield self.length, (ANCHOR if self.is_anchor else ENTRY)
        for length, kind in sorted(self.checkpoints, key=lambda c: -c[0]):
            yield length, kind


@dataclass(frozen=True)
class RestorePlan:
    """Where a prompt restores from; ``length == 0`` is a cold prefill. Same shape on hit and miss."""

    length: int
    kind: str
    tier: str | None = None
    entry: Entry | None = None
    checkpoint: Checkpoint | None = None
    record: DiskRecord | None = None
    shared: int = 0  # longest prefix the prompt shares with anything stored (the divergence point)
    prompt_len: int = 0
    # The longest restore point that is no reply state (neither a head past its reply nor a
    # reply end): what the prompt would restore without reply reuse, and what capture gains
    # are measured from. -1: the same as ``length``.
    durable: int = -1

    @property
    def durable_length(self) -> int:
        return self.length if self.durable < 0 else min(self.durable, self.length)

    @property
    def hit(self) -> bool:
        return self.length > 0

    @property
    def state(self) -> SnapshotHandle | None:
        """The snapshot to restore (RAM plans only)."""
        if self.entry is None:
            return None
        return self.entry.head if self.checkpoint is None else self.checkpoint.state

    @property
    def log_kind(self) -> str:
        """The kind as the per-request log names it: disk hits are 'disk'."""
        return DISK if self.tier == DISK and self.hit else self.kind


@dataclass(frozen=True)
class Capture:
    """A length at which prefill must stop and hand the snapshot layers' state to commit."""

    length: int
    kind: str  # a checkpoint kind (RestoreKind), or ANCHOR


@dataclass(frozen=True)
class Event:
    """A cache event for logs, the admin event stream and the journal."""

    kind: str  # an EventKind
    entry_id: str
    length: int = 0
    nbytes: int = 0
    detail: str = ""
