"""A row's buffers from restore to leaving the batch: loans, deferred entries, tracked replies.

The coordinator answers mlx-vlm's verbs; what happens to a row's KV buffers in between is
decided here, over the three books in ``server_patch.copyfree`` and the generator's rows:

* at admission a lone request that extends an entry at its head is *lent* the entry's buffer
  (``may_lend``), or the entry is rewound to the protected prompt end it restores at so it
  can be (``may_rewind``); anything it would restore from is made real first (``settle``);
* at the prefill end a lone row is *deferred* (its buffer adopted when nothing writes it any
  more), a row sharing its batch is copied out once, or with reply reuse deferred to its end
  (``prefill_end``), and the row is tracked to move its entry past its reply;
* when rows leave the decoding batch, are concatenated into a shared one, or are removed
  mid-prefill (``leaving``, ``joining``, ``removed``), deferred entries are committed, replies
  kept, and loans end.

Every step runs on the generation thread, the only one that writes caches.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from server_patch.copyfree import lease as lending
from server_patch.copyfree import merge as copyfree_merge
from server_patch.copyfree.deferred import Deferred, DeferredBook, commit_reply
from server_patch.copyfree.replies import Reply, ReplyBook
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.integration.generator import GeneratorView
from server_patch.integration.pending import Pending, RequestKey
from server_patch.integration.runtime import LineageRuntime
from server_patch.lineage import RestorePlan
from server_patch.state import rows

log = logging.getLogger("server_patch.lineage")


class Commits(Protocol):
    """Where a row's state becomes an entry (the request flow's commits)."""

    def store(self, pending: Pending, kv: Any, head: Any) -> bool:
        """At the prompt end."""
        ...

    def store_reply(self, pending: Pending, fed: np.ndarray, **state: Any) -> Any:
        """Past the reply: ``kv``, ``head``, ``prompt_head``, ``captures``."""
        ...

    def note_commit(self, pending: Pending, uid: Any, start: float) -> None:
        """The commit's time and captures, on the request's timing record."""
        ...


class BatchRows:
    """The loans, deferred entries and tracked replies of one runtime's batch rows."""

    def __init__(self, runtime: LineageRuntime, settings: CopyFreeSettings, generator: GeneratorView,
                 commits: Commits) -> None:
        self.runtime, self.settings, self.generator, self.commits = runtime, settings, generator, commits
        self.deferred = DeferredBook(runtime.layout, settings, runtime.timings, self._store)
        self.leases = lending.LeaseBook(runtime.layout, runtime.cache)
        self.replies = ReplyBook()

    # ------------------------------------------------------------------ admission

    def sweep(self) -> None:
        """Forget tracked replies of rows no batch holds any more."""
        if len(self.replies) and (active := self.generator.active_uids()) is not None:
            self.replies.sweep(active)

    def settle(self, prompt: np.ndarray, namespace: str, plan: RestorePlan, reclaimed: set[str]) -> bool:
        """The flow's settle hook: commit deferred entries this plan would miss, end loans of
        the rows it needs (their ids go into ``reclaimed``). True: plan again."""
        active = self.generator.active_uids()
        if self.deferred and self.deferred.surface(prompt, namespace, plan.length, active=active,
                                                   row_of=self.generator.row_of, forget=self.replies.take):
            return True  # a deferred entry was committed: there may be a longer restore point
        return bool(self.leases) and self.leases.sweep(plan.entry, reclaimed, active)

    def may_rewind(self, plan: RestorePlan) -> bool:
        """A prompt that restores at an entry's protected prompt end (it did not re-render the
        reply) would be lent the buffer if the head sat there: the flow may rewind the entry
        (give up the reply's state, ``LineageCache.rewind``) so the turn appends in place as it
        would without reply reuse instead of copying the entry."""
        entry = plan.entry
        if not self._lendable_layout() or entry is None or entry.is_anchor or not self.generator.plain():
            return False
        return lending.has_room(entry.kv, plan.prompt_len + self.settings.decode_reserve)

    def may_lend(self, plan: RestorePlan) -> bool:
        """A lone-request loan is possible: a RAM entry restored at its own head, whose
        adopted buffer already has room for the suffix and the decode reserve."""
        entry = plan.entry
        if not self._lendable_layout() or plan.checkpoint is not None or entry is None:
            return False
        if entry.is_anchor or plan.length != entry.length or not self.generator.plain():
            return False
        return lending.lendable(entry.kv, plan.length, plan.prompt_len + self.settings.decode_reserve)

    def _lendable_layout(self) -> bool:
        """Lending is on and every KV layer is float: a quantized layer (``--kv-bits``) is
        merged by mlx-vlm's packed merge, which copies, so there is no buffer to lend."""
        return self.settings.lending and not self.runtime.layout.packed

    def restore(self, key: RequestKey, plan: RestorePlan, reclaimed: set[str]) -> tuple[list[Any], bool]:
        """The restored row caches (truncated views, or the entry's own lent buffers) and
        whether they were lent. Raises if they cannot be built (a lent entry cannot)."""
        entry = plan.entry
        assert entry is not None
        if key not in self.leases and entry.id not in reclaimed and self.may_lend(plan):
            return self.leases.lend(key, entry, plan.state, plan.length), True
        return self.runtime.layout.build(entry.kv, plan.state, plan.length), False

    def merge(self, keys: Sequence[Optional[RequestKey]], row_caches: Sequence[Sequence[Any]],
              prefix_lens: Sequence[int], suffixes: Sequence[int]) -> Optional[list[Any]]:
        """One copy per restored row into buffers with room for the suffix and the decode
        reserve; none when a lone row was lent its entry's buffer. None: stock's merge."""
        leases = [self.leases.get(key) if key is not None else None for key in keys]
        lone = leases[0] if len(keys) == 1 else None
        for lease in leases:
            if lease is not None and lease is not lone:  # rows sharing a batch: the merge copies
                self.leases.end(lease, reason="batch")
        headroom = self.settings.lend_headroom if len(keys) == 1 and self.settings.lending else 0
        caches = copyfree_merge.merge_rows(row_caches, prefix_lens, suffixes, self.settings.decode_reserve,
                                           headroom=headroom, lend=lone is not None)
        if lone is not None:
            if caches is None:
                self.leases.end(lone, reason="fallback")
            else:
                lone.holder, lone.merged = list(caches), True
        return caches

    def bind(self, key: RequestKey, uid: Any) -> None:
        self.leases.bind(key, uid)

    # ------------------------------------------------------------------ prefill end

    def prefill_end(self, pending: Pending, prompt_cache: Sequence[Any], batch_idx: Optional[int],
                    uid: Any) -> bool:
        """Commit the row's entry at its prompt end: deferred (a lone row; with reply reuse a
        shared one too, copied out once when it ends) or copied out now."""
        start = time.perf_counter()
        layout = self.runtime.layout
        lone = self._deferrable(prompt_cache, uid)
        if lone or (self.settings.enabled and self.reply_reuse(pending, uid)):
            head = rows.capture(layout, prompt_cache, batch_idx, pending.final)
            self.deferred.add(Deferred(pending, head, list(prompt_cache) if lone else [], uid,
                                       time.monotonic(), shared=not lone))
            committed = True
        else:
            kv, head = rows.extract(layout, prompt_cache, batch_idx, pending.final)
            committed = self._store(pending, kv, head)
        self.track_reply(pending, head, uid)
        self.commits.note_commit(pending, uid, start)
        return committed

    def _store(self, pending: Pending, kv: Any, head: Any) -> bool:
        committed = self.commits.store(pending, kv, head)
        self._settle_leases()  # a loan whose entry the commit absorbed is over
        return committed

    def _deferrable(self, prompt_cache: Sequence[Any], uid: Any) -> bool:
        """A lone row of a plain (non-speculative) batch: its buffer is its own to hand over."""
        if not (self.settings.enabled and self.settings.adopt) or uid is None or not self.generator.plain():
            return False
        return rows.batch_size(prompt_cache) == 1

    # ------------------------------------------------------------------ reply reuse

    def reply_reuse(self, pending: Pending, uid: Any) -> bool:
        """Whether this row's entry may move past its reply when it ends. Off, explicitly:
        ``APC_LINEAGE_REPLY_REUSE=0``; the single-sequence path (no uid: its loop has no
        decode hook); draft-model batches (``SpeculativeGenerationBatch`` reports no fed ids,
        and its caches hold draft rows it may roll back); a prompt end moved off n - 1."""
        config = self.runtime.config
        if not config.reply_reuse or uid is None or not self.generator.plain():
            return False
        return pending.final == int(pending.tokens.shape[0]) - config.entry_offset

    def track_reply(self, pending: Pending, head: Any, uid: Any) -> None:
        """Record the ids row ``uid`` is fed from now on (``head``: its prompt-end state)."""
        if self.reply_reuse(pending, uid):
            self.replies.track(uid, Reply(pending, head, self.runtime.timings.by_uid(uid)))

    def decoded(self, uids: Sequence[Any], tokens: Sequence[int]) -> None:
        if len(self.replies):
            self.replies.decoded(uids, tokens)

    def _keep_reply(self, reply: Reply, batch: Any, idx: int, *, alone: bool,
                    deferred: Optional[Deferred]) -> bool:
        """Move the row's entry past its reply (``copyfree.deferred.commit_reply``)."""
        return commit_reply(self.runtime.layout, self.settings, reply, batch, idx, alone=alone,
                            deferred=deferred, settle=self._settle_leases, store=self.commits.store_reply)

    def _settle_leases(self) -> None:
        """Loans whose entry was absorbed or evicted are over."""
        if self.leases:
            self.leases.settle()

    # ------------------------------------------------------------------ rows going away

    def leaving(self, batch: Any, keep: Sequence[int]) -> None:
        """``GenerationBatch.filter``: rows not in ``keep`` stop writing their caches now.
        A tracked row's entry moves past its reply; otherwise a deferred one is committed at
        its prompt end."""
        if not self.deferred and not self.leases and not len(self.replies):
            return
        kept = set(keep)
        alone = len(batch.uids) == 1
        for i, uid in enumerate(list(batch.uids)):
            if i in kept:
                continue
            reply = self.replies.take(uid)
            deferred = self.deferred.pop(uid)
            kept_reply = reply is not None and self._keep_reply(reply, batch, i, alone=alone, deferred=deferred)
            if deferred is not None and not kept_reply:
                self.deferred.resolve(deferred, list(batch.prompt_cache), i, adopt=alone, reason="end")
            self.leases.end_of(uid, batch.prompt_cache if alone else None, reason="end")

    def joining(self, existing: Any, incoming: Any) -> None:
        """Before ``existing.extend(incoming)``: a lone row's buffer is about to be replaced by
        the concatenation, so it can be adopted as it is."""
        if (not self.deferred and not self.leases) or len(existing) == 0:
            return
        for batch in (existing, incoming):
            alone = len(batch.uids) == 1
            for i, uid in enumerate(list(batch.uids)):
                deferred = self.deferred.get(uid)
                if deferred is not None and not deferred.shared:  # shared rows move along, by uid
                    self.deferred.resolve(self.deferred.pop(uid), list(batch.prompt_cache), i, adopt=alone,
                                          reason="join")
                self.leases.end_of(uid, batch.prompt_cache if alone else None, reason="join")

    def removed(self, uid: Any) -> None:
        """A request is taken out of the prompt batch mid-prefill: its loan ends now, it will
        feed no reply, and a deferred row sharing the batch is committed now, while it is there."""
        self.replies.take(uid)
        deferred = self.deferred.get(uid)
        if deferred is not None and deferred.shared and (found := self.generator.row_of(uid)) is not None:
            self.deferred.pop(uid)
            self.deferred.resolve(deferred, found[0], found[1], adopt=False, reason="removed")
        self.leases.end_of(uid, None, reason="removed")


__all__ = ["BatchRows", "Commits"]
