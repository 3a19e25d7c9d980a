"""Prompts through prefill: the captures each asks for, the snapshots it takes, its commits.

Between lookup and the prefill end a prompt is ``Pending`` (``integration.pending``). mlx-vlm
asks for the lengths where prefill must stop (``lengths``) and hands over the state at each
(``take``); what is captured and what becomes the entry is the request flow's
(``lineage.flow.Admission``: captures, commit, commit_reply), so the simulator makes the same
choices. A request has one admission, built by its lookup and kept in its pending prompt
(``Pending.flow``): its captures, its prompt-end commit and its reply commit all use it. The boundaries a capture may use (the anchor, chat-template segments) come from the
``apply_chat_template`` wrapper (``integration.segments``).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import numpy as np

from server_patch.integration.pending import Pending, namespace_of
from server_patch.integration.session import SessionBook, Session
from server_patch.integration.runtime import LineageRuntime
from server_patch.lineage import ANCHOR, COLD, RestorePlan, as_tokens
from server_patch.lineage.flow import Admission, cold
from server_patch.state import rows
from server_patch.lineage.model import Entry
from server_patch.state.layout import MlxKV, MlxSnapshot


class Prefills:
    """The prefilling rows of one runtime (``SessionBook``), and where their state is committed."""

    def __init__(self, runtime: LineageRuntime, book: SessionBook) -> None:
        self.runtime = runtime
        self.book = book

    def flow(self, pending: Pending) -> Admission:
        """The request flow of a pending prompt, at its admitted plan: its one admission."""
        return pending.flow(self.runtime.cache)

    # ------------------------------------------------------------------ captures

    def lengths(self, token_ids: Sequence[int], media_token_ids: set[int], final: int) -> list[int]:
        """Where prefill must hand over state: every pending prompt's captures with these
        tokens (no namespace here, see ``pending``), and the prefill end ``final``."""
        prompt = as_tokens(token_ids)
        pendings = [row.pending for row in self.book.with_tokens(prompt)] or [self._unlooked(prompt)]
        text_only = not (media_token_ids and np.isin(prompt, list(media_token_ids)).any())
        for pending in pendings:
            if pending.final == 0:
                pending.final = final
                if text_only:  # checkpoints inside media regions are not text-aligned: final only
                    self._plan_captures(pending)
        return sorted({final}.union(*(p.wanted for p in pendings)))

    def _plan_captures(self, pending: Pending) -> None:
        info = self.runtime.boundaries(pending.tokens)  # anchor + chat-template segment boundaries
        pending.anchor_label = info.anchor_label
        flow = self.flow(pending)
        captures = flow.captures(anchor_len=info.anchor_len, segments=info.segments,
                                 drift_points=self.runtime.drift_points(pending.tokens, pending.namespace or ""))
        pending.wanted = {c.length: c.kind for c in captures if c.length <= pending.final}

    def _unlooked(self, prompt: np.ndarray) -> Pending:
        """A prompt that skipped lookup: planned as cold, its namespace named by its first store."""
        pending = Pending(prompt, None, cold(RestorePlan(0, COLD, prompt_len=int(prompt.shape[0]))))
        self.book.admit(pending)
        return pending

    def take(self, token_ids: Sequence[int], prompt_cache: Sequence[Any], extra_hash: int,
             batch_idx: Optional[int], uid: Optional[int] = None) -> tuple[bool, list[Session]]:
        """The state after ``token_ids`` of batch row ``batch_idx``: a capture (references to
        the snapshot layers) for row ``uid`` if it wants one here; it is the one row whose state
        this is (an identical prompt in the same batch is another row, with its own store). A
        store with no uid, or whose uid names no looked-up row (the single-sequence path), goes
        to the unbound rows that want it, one per request key, the newest. Returns whether any
        was taken, and the rows whose prefill ends here (the caller commits them)."""
        prefix = as_tokens(token_ids)
        length = int(prefix.shape[0])
        found = self.book.matching(prefix, namespace_of(extra_hash))
        own = self.book.by_uid(uid) if uid is not None else None
        if own is not None:
            chosen = [own] if own in found else []
        else:
            newest: dict[tuple[Optional[str], int, int], Session] = {row.key: row for row in found if row.uid is None}
            chosen = list(newest.values())
        snapshot = None
        for pending in (row.pending for row in chosen):
            if length in pending.wanted and length != pending.final:
                if snapshot is None:
                    snapshot = rows.capture(self.runtime.layout, prompt_cache, batch_idx, length)
                pending.taken[length] = (pending.wanted[length], snapshot)
        return snapshot is not None, [row for row in chosen if length == row.pending.final]

    @staticmethod
    def resend(row: Session) -> bool:
        """A prompt restored at its own prompt end (a regenerate, a retry): nothing is left to
        prefill, so no store will commit it; its restored state is its prompt-end snapshot."""
        pending = row.pending
        return bool(pending.final) and pending.plan.hit and pending.plan.length == pending.final

    # ------------------------------------------------------------------ commits

    def store(self, pending: Pending, kv: MlxKV, head: MlxSnapshot) -> bool:
        """The state at the prompt end becomes the lineage's entry."""
        if pending.wanted.get(pending.final) == ANCHOR:
            pending.taken[pending.final] = (ANCHOR, head)
        entry = self.flow(pending).commit(kv=kv, head=head, captures=pending.taken,
                                          anchor_label=pending.anchor_label)
        return entry is not None

    def store_reply(self, pending: Pending, fed: np.ndarray, /, *, kv: MlxKV, head: MlxSnapshot,
                    prompt_head: MlxSnapshot, captures: dict[int, tuple[str, MlxSnapshot]]) -> Optional[Entry]:
        """The state past the reply becomes the entry; the prompt end stays its checkpoint."""
        return self.flow(pending).commit_reply(fed, kv=kv, head=head, prompt_head=prompt_head, captures=captures,
                                               anchor_label=pending.anchor_label)

    @staticmethod
    def note_commit(row: Session, start: float) -> None:
        """The commit's time and captures, on the row's timing record."""
        if (record := row.record) is not None:
            record.commit_ms += (time.perf_counter() - start) * 1000
            record.captures = [f"{kind}@{n}" for n, (kind, _) in sorted(row.pending.taken.items())]


__all__ = ["Prefills"]
