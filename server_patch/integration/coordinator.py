"""mlx-vlm's APC coordinator, with the lineage cache behind its checkpoint-mode verbs.

0.7.10's batch generator already does the hard part: it asks the coordinator for a lookup at
admission, for the lengths where prefill must stop, calls ``store_checkpoint`` exactly when a
row has processed each length, and merges restored rows into the batch. We answer those calls
from the lineage policy, through the request flow the simulator runs too
(``server_patch.lineage.flow``: admission, captures, commits):

* ``lookup``: the flow's admitted restore point, built as truncated views (no restore clone).
  It plans until the plan is stable (deferred entries committed, loans of the rows it needs
  ended, a disk restore point loaded or its file rejected), so whatever plan is admitted has
  been swept; a lent entry cannot be built from at all (``CacheLayout.build`` raises: cold);
* ``merge_rows``: the one copy of a warm turn, into batch buffers with room for the suffix
  and a decode reserve (``server_patch.copyfree.merge``); or no copy at all when a lone
  request extends an entry whose adopted buffer has room: the entry lends it the buffer
  (``server_patch.copyfree.lease``) and gets it back, or is absorbed, when the request ends;
* ``checkpoint_lengths``: the policy's captures (anchor, divergence, periodic, guard,
  segments) plus the prefill end n-1, where the entry is committed;
* ``store_checkpoint``: a capture takes references to the snapshot layers only. At the
  prefill end a row that shares its batch buffer with other rows is copied out once and
  committed (with reply reuse it is deferred too, and copied out once when it ends). A row
  alone in its batch is *deferred*: its snapshot is kept (references) and its own KV buffer
  is adopted, truncated, once nothing writes it any more: when the request leaves the
  decoding batch (``rows_leaving``) or its rows are concatenated into a shared batch
  (``batches_joining``). A lookup that would restore from a deferred entry commits it first,
  by a copy, so deferral never hides a restore point (``server_patch.copyfree.deferred``).

Reply reuse (``APC_LINEAGE_REPLY_REUSE``, on by default): a row of the batched, non-speculative
path is tracked from its prefill end (``server_patch.copyfree.replies``: the ids each decode
step fed). When it leaves the decoding batch (finished, stopped, length, cancelled) and its
caches provably hold prompt + exactly those ids, its entry's head moves past the reply
(``copyfree.deferred.commit_reply``): a lone row's buffer is adopted as it is (the reply's KV rows
are already in it), a row of a multi-row batch is copied out once. The prompt end stays the
entry's protected checkpoint; anything that does not check out leaves the entry there. A
prompt that restores at that point and could be lent the buffer rewinds the entry to it first
(``_may_rewind``). Off by explicit check: the single-sequence path (no uid, no decode hook),
draft-model batches, and ``APC_LINEAGE_REPLY_REUSE=0``.

Every request is named by its namespace and its tokens (``pending.request_key``): pending
prompts, loans and timing records never mix two tenants that send the same tokens.

Block-mode (pure attention) models keep stock behaviour. ``APC_COPYFREE=0`` keeps the stock
merge and commits every entry by an immediate copy.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
from mlx_vlm.apc_coordinator import APCCoordinator

from server_patch import canary
from server_patch.copyfree import pool
from server_patch.copyfree.deferred import Deferred, DeferredBook, commit_reply
from server_patch.copyfree import lease as lending
from server_patch.copyfree import merge as copyfree_merge
from server_patch.copyfree.replies import Reply, ReplyBook
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.integration import segments as SEGMENTS
from server_patch.integration.pending import Pending, PendingBook, RequestKey, namespace_of, request_key
from server_patch.integration.runtime import LineageRuntime, runtime_for
from server_patch.lineage import ANCHOR, DISK, RestorePlan, as_tokens
from server_patch.lineage.flow import Admission, cold
from server_patch.state import rows
from server_patch.state.layout import MlxKV

log = logging.getLogger("server_patch.lineage")

class LineageCoordinator(APCCoordinator):
    """APCCoordinator whose checkpoint mode is the lineage cache."""

    def __init__(self, manager: Any, model: Any) -> None:
        super().__init__(manager, model)
        self.runtime: LineageRuntime | None = None
        if self.enabled and self.is_checkpoint:
            language_model = getattr(model, "language_model", model)
            self.runtime = runtime_for(manager, language_model)
        self._pending = PendingBook()
        self.copyfree: CopyFreeSettings = pool.configure()
        self._generator: Callable[[], Any] | None = None
        self._deferred = DeferredBook(self.runtime and self.runtime.layout, self.copyfree,
                                      self.runtime and self.runtime.timings, self._store)
        self._leases = lending.LeaseBook(*(() if self.runtime is None else
                                           (self.runtime.layout, self.runtime.cache)))
        self._replies = ReplyBook()

    def attach_generator(self, generator: Any) -> None:
        """The batch generator this coordinator serves (weakly): who else is decoding."""
        self._generator = weakref.ref(generator)

    # ------------------------------------------------------------------ admission

    def lookup(self, token_ids: Sequence[int], *, extra_hash: int, safe_lookup_min: int,
               suffix_is_text_only: Callable[[int], bool],
               prefix_has_media: Callable[[int], bool]) -> Optional[dict]:
        if self.runtime is None:
            return super().lookup(token_ids, extra_hash=extra_hash, safe_lookup_min=safe_lookup_min,
                                  suffix_is_text_only=suffix_is_text_only,
                                  prefix_has_media=prefix_has_media)
        start = time.perf_counter()
        cache, layout = self.runtime.cache, self.runtime.layout
        prompt = as_tokens(token_ids)
        namespace = namespace_of(extra_hash)
        key = request_key(namespace, prompt)
        record = self.runtime.timings.open(key, int(prompt.shape[0]))
        if len(self._replies):
            active = self._active_uids()
            if active is not None:
                self._replies.sweep(active)
        reclaimed: set[str] = set()  # entries whose loans this lookup ended: never lent again now
        disk = self.runtime.disk
        admission = Admission.admit(cache, prompt, namespace, disk=_Loader(disk) if disk is not None else None,
                                    settle=lambda plan: self._settle(prompt, namespace, plan, reclaimed),
                                    disk_refused=lambda: canary.refuses(DISK))
        plan = admission.plan
        if key not in self._leases and plan.entry is not None and plan.entry.id not in reclaimed:
            plan = admission.rewind(self._may_rewind)
        if plan.hit and canary.refuses(plan.kind):  # a failed canary check (ON_FAIL=cold): cold
            plan = admission.refuse()
        warm = None
        lent = False
        if plan.hit and plan.length >= safe_lookup_min and suffix_is_text_only(plan.length):
            try:
                if key not in self._leases and plan.entry.id not in reclaimed and self._may_lend(plan):
                    warm = self._leases.lend(key, plan.entry, plan.state, plan.length)
                    lent = True
                else:
                    warm = layout.build(plan.entry.kv, plan.state, plan.length)  # raises if lent
            except Exception as exc:  # fail closed: a cold prefill, never garbage
                log.warning("apc_lineage restore of %s at %d failed: %s", plan.entry.id, plan.length, exc)
        if warm is None:
            admission.refuse()
        self._pending.remember(Pending(prompt, namespace, admission.plan))
        record.lookup_ms = (time.perf_counter() - start) * 1000
        if warm is None:
            admission.cold()
            return None
        kv_admission = "lent" if lent else "copied"
        admission.restored(kv_admission)
        record.restore_kind = DISK if admission.tier == DISK else plan.kind
        record.restored_tokens = plan.length
        record.entry_id = plan.entry.id
        record.kv_admission = kv_admission
        record.admission_ms = record.lookup_ms
        return {"matched_blocks": [], "warm_cache": warm, "prefix_len": plan.length,
                "extra_hash": extra_hash, "full_input_ids": list(token_ids), "cache_plan": self.plan}

    def _settle(self, prompt: np.ndarray, namespace: str, plan: RestorePlan, reclaimed: set[str]) -> bool:
        """The flow's settle hook: commit deferred entries this plan would miss, end loans of
        the rows it needs. True if the plan may have changed (plan again)."""
        if self._deferred and self._deferred.surface(prompt, namespace, plan.length, active=self._active_uids(),
                                                     row_of=self._row_of, forget=self._replies.take):
            return True  # a deferred entry was committed: there may be a longer restore point
        return bool(self._leases) and self._leases.sweep(plan.entry, reclaimed, self._active_uids())

    def merge_rows(self, picks: Sequence[Optional[dict]], prefix_lens: Sequence[int], *,
                   kv_quant_config: Optional[dict] = None):
        start = time.perf_counter()
        result = None
        if self.runtime is not None and self.copyfree.enabled and kv_quant_config is None:
            result = self._merge_copyfree(picks, prefix_lens)
        if result is None:
            result = super().merge_rows(picks, prefix_lens, kv_quant_config=kv_quant_config)
        if self.runtime is not None:
            merge_ms = (time.perf_counter() - start) * 1000
            for pick in picks:
                if pick is None:
                    continue
                record = self.runtime.timings.by_key(_key_of(pick))
                if record is not None:
                    record.admission_ms += merge_ms
        return result

    def _merge_copyfree(self, picks: Sequence[Optional[dict]], prefix_lens: Sequence[int]):
        """One copy per restored row, into buffers sized for prefix + suffix + reserve."""
        memory = self.manager.memory_plan
        if len(prefix_lens) == len(memory.lengths):
            totals = list(memory.lengths)
            self.prepare_prefill(totals, prefill_step_size=memory.chunk_size, prefix_lengths=prefix_lens)
        else:  # cold rows' lengths unknown: they may regrow once, warm rows never do
            totals = [len(p["full_input_ids"]) if p else n for p, n in zip(picks, prefix_lens)]
        suffixes = [max(0, total - n) for total, n in zip(totals, prefix_lens)]
        row_caches = [p["warm_cache"] if p is not None else self.fresh_cache() for p in picks]
        leases = [self._leases.get(_key_of(p)) if p else None for p in picks]
        lone = leases[0] if len(picks) == 1 else None
        for lease in leases:
            if lease is not None and lease is not lone:  # rows sharing a batch: the merge copies
                self._leases.end(lease, reason="batch")
        headroom = self.copyfree.lend_headroom if len(picks) == 1 and self.copyfree.lending else 0
        caches = copyfree_merge.merge_rows(row_caches, prefix_lens, suffixes, self.copyfree.decode_reserve,
                                           headroom=headroom, lend=lone is not None)
        if caches is None:
            if lone is not None:
                self._leases.end(lone, reason="fallback")
            return None
        if lone is not None:
            lone.holder, lone.merged = list(caches), True
        with self.manager.lock:
            self.manager.stats.restored_tokens += sum(prefix_lens)
        return caches, max(prefix_lens) if prefix_lens else 0

    def bind_rows(self, uids: Sequence[Any], metas: Sequence[Optional[dict]]) -> None:
        """Tie each row's timing record to the generator's uid (called when a batch is built)."""
        if self.runtime is None or not metas:
            return
        for uid, meta in zip(uids, metas):
            if meta is not None and "full_input_ids" in meta:
                key = _key_of(meta)
                self.runtime.timings.bind(uid, key)
                self._leases.bind(key, uid)
                self._track_resend(key, uid)

    def _track_resend(self, key: RequestKey, uid: Any) -> None:
        """A prompt restored at its own prompt end (a regenerate, a retry) has nothing left to
        prefill, so no ``store_checkpoint`` commits it: its reply is tracked here, with the
        restored state as the prompt-end snapshot, so the entry still moves past the new reply."""
        pending = self._pending.get(key)
        if pending is None or not pending.final or not pending.plan.hit or pending.plan.length != pending.final:
            return
        self._pending.forget(pending)
        self._track_reply(pending, pending.plan.state, uid)

    # ------------------------------------------------------------------ captures

    def checkpoint_lengths(self, token_ids: Sequence[int], media_token_ids: set[int]) -> list[int]:
        if self.runtime is None:
            return super().checkpoint_lengths(token_ids, media_token_ids)
        final = self.checkpoint_len(token_ids, media_token_ids)
        if final <= 0:
            return []
        prompt = as_tokens(token_ids)
        # No namespace here (see ``pending``): plan every pending prompt with these tokens.
        pendings = self._pending.with_tokens(prompt) or [self._unlooked(prompt)]
        text_only = not (media_token_ids and np.isin(prompt, list(media_token_ids)).any())
        for pending in pendings:
            if pending.final == 0:
                pending.final = final
                if text_only:  # checkpoints inside media regions are not text-aligned: final only
                    self._plan_captures(pending)
        return sorted({final}.union(*(p.wanted for p in pendings)))

    def _plan_captures(self, pending: Pending) -> None:
        assert self.runtime is not None
        info = SEGMENTS.boundaries(pending.tokens)  # anchor + chat-template segment boundaries
        pending.anchor_label = info.anchor_label
        captures = self._flow(pending).captures(anchor_len=info.anchor_len, segments=info.segments)
        pending.wanted = {c.length: c.kind for c in captures if c.length <= pending.final}

    def store_checkpoint(self, token_ids: Sequence[int], prompt_cache: Sequence[Any], *,
                         extra_hash: int = 0, batch_idx: Optional[int] = None, uid: Any = None) -> bool:
        if self.runtime is None:
            return super().store_checkpoint(token_ids, prompt_cache, extra_hash=extra_hash,
                                            batch_idx=batch_idx)
        prefix = as_tokens(token_ids)
        length = int(prefix.shape[0])
        matches = self._pending.matching(prefix, namespace_of(extra_hash))
        if not matches:
            return False
        snapshot = None
        for pending in matches:
            if length in pending.wanted and length != pending.final:
                if snapshot is None:
                    snapshot = rows.capture(self.runtime.layout, prompt_cache, batch_idx, length)
                pending.taken[length] = (pending.wanted[length], snapshot)
        committed = False
        for pending in matches:
            if length == pending.final:
                committed = self._commit(pending, prompt_cache, batch_idx, uid) or committed
        return committed or snapshot is not None

    def _commit(self, pending: Pending, prompt_cache: Sequence[Any], batch_idx: Optional[int],
                uid: Any) -> bool:
        start = time.perf_counter()
        runtime = self.runtime
        assert runtime is not None
        self._pending.forget(pending)
        lone = self._deferrable(prompt_cache, uid)
        if lone or (self.copyfree.enabled and self._reply_reuse(pending, uid)):
            # A row sharing its batch is copied out once, when it ends, past its reply.
            head = rows.capture(runtime.layout, prompt_cache, batch_idx, pending.final)
            self._deferred.add(Deferred(pending, head, list(prompt_cache) if lone else [], uid,
                                        time.monotonic(), shared=not lone))
            self._track_reply(pending, head, uid)
            self._note_commit(pending, uid, start)
            return True
        kv, head = rows.extract(runtime.layout, prompt_cache, batch_idx, pending.final)
        committed = self._store(pending, kv, head)
        self._track_reply(pending, head, uid)
        self._note_commit(pending, uid, start)
        return committed

    def _store(self, pending: Pending, kv: Any, head: Any) -> bool:
        assert self.runtime is not None
        if pending.wanted.get(pending.final) == ANCHOR:
            pending.taken[pending.final] = (ANCHOR, head)
        entry = self._flow(pending).commit(kv=kv, head=head, captures=pending.taken,
                                           anchor_label=pending.anchor_label)
        if self._leases:
            self._leases.settle()
        return entry is not None

    # ------------------------------------------------------------------ reply reuse

    def _reply_reuse(self, pending: Pending, uid: Any) -> bool:
        """Whether this row's entry may move past its reply when it ends. Off, explicitly:
        ``APC_LINEAGE_REPLY_REUSE=0``; the single-sequence path (no uid: its loop has no
        decode hook); draft-model batches (``SpeculativeGenerationBatch`` reports no fed ids,
        and its caches hold draft rows it may roll back); a prompt end moved off n - 1."""
        assert self.runtime is not None
        if not self.runtime.config.reply_reuse or uid is None:
            return False
        if not self._plain_generator():
            return False
        return pending.final == int(pending.tokens.shape[0]) - self.runtime.config.entry_offset

    def _track_reply(self, pending: Pending, head: Any, uid: Any) -> None:
        assert self.runtime is not None
        if self._reply_reuse(pending, uid):
            record = self.runtime.timings.by_uid(uid)
            self._replies.track(uid, Reply(pending, head, record))

    def rows_decoded(self, batch: Any, tokens: Sequence[int]) -> None:
        """``GenerationBatch.next``: ``tokens[i]`` was just fed to row ``batch.uids[i]``."""
        if len(self._replies):
            self._replies.decoded(list(batch.uids), tokens)

    def _commit_reply(self, reply: Reply, batch: Any, idx: int, *, alone: bool,
                      deferred: Optional[Deferred]) -> bool:
        """Move the row's entry past its reply (``copyfree.deferred.commit_reply``)."""
        assert self.runtime is not None
        return commit_reply(self.runtime.layout, self.copyfree, reply, batch, idx, alone=alone,
                            deferred=deferred, settle=self._settle_leases,
                            store=lambda pending, fed, **state: self._flow(pending).commit_reply(
                                fed, anchor_label=pending.anchor_label, **state))

    def _settle_leases(self) -> None:
        if self._leases:
            self._leases.settle()

    def _note_commit(self, pending: Pending, uid: Any, start: float) -> None:
        assert self.runtime is not None
        timings = self.runtime.timings
        record = timings.by_uid(uid) if uid is not None else timings.by_key(pending.key)
        if record is not None:
            record.commit_ms += (time.perf_counter() - start) * 1000
            record.captures = [f"{kind}@{n}" for n, (kind, _) in sorted(pending.taken.items())]

    # ------------------------------------------------------------------ deferred entries

    def _deferrable(self, prompt_cache: Sequence[Any], uid: Any) -> bool:
        """A lone row of a plain (non-speculative) batch: its buffer is its own to hand over."""
        if not (self.copyfree.enabled and self.copyfree.adopt) or uid is None:
            return False
        if not self._plain_generator():
            return False
        return rows.batch_size(prompt_cache) == 1

    def rows_leaving(self, batch: Any, keep: Sequence[int]) -> None:
        """``GenerationBatch.filter``: rows not in ``keep`` stop writing their caches now.
        A tracked row's entry moves past its reply; otherwise a deferred one is committed at
        its prompt end."""
        if not self._deferred and not self._leases and not len(self._replies):
            return
        kept = set(keep)
        alone = len(batch.uids) == 1
        for i, uid in enumerate(list(batch.uids)):
            if i in kept:
                continue
            reply = self._replies.take(uid)
            deferred = self._deferred.pop(uid)
            kept_reply = reply is not None and self._commit_reply(reply, batch, i, alone=alone,
                                                                  deferred=deferred)
            if deferred is not None and not kept_reply:
                self._deferred.resolve(deferred, list(batch.prompt_cache), i, adopt=alone, reason="end")
            self._leases.end_of(uid, batch.prompt_cache if alone else None, reason="end")

    def batches_joining(self, existing: Any, incoming: Any) -> None:
        """Before ``existing.extend(incoming)``: a lone row's buffer is about to be replaced by
        the concatenation, so it can be adopted as it is."""
        if (not self._deferred and not self._leases) or len(existing) == 0:
            return
        for batch in (existing, incoming):
            alone = len(batch.uids) == 1
            for i, uid in enumerate(list(batch.uids)):
                deferred = self._deferred.get(uid)
                if deferred is not None and not deferred.shared:  # shared rows move along, by uid
                    self._deferred.resolve(self._deferred.pop(uid), list(batch.prompt_cache), i, adopt=alone,
                                           reason="join")
                self._leases.end_of(uid, batch.prompt_cache if alone else None, reason="join")

    def request_removed(self, uid: Any) -> None:
        """A request is taken out of the prompt batch mid-prefill: its loan ends now, it will
        feed no reply, and a deferred row sharing the batch is committed now, while it is there."""
        self._replies.take(uid)
        deferred = self._deferred.get(uid)
        if deferred is not None and deferred.shared:
            found = self._row_of(uid)
            if found is not None:
                self._deferred.pop(uid)
                self._deferred.resolve(deferred, found[0], found[1], adopt=False, reason="removed")
        self._leases.end_of(uid, None, reason="removed")

    def _row_of(self, uid: Any) -> Optional[tuple[list[Any], int]]:
        """Where row ``uid`` is now: (its batch's caches, its index) in the decoding batch or
        the prompt batch; None if neither holds it."""
        generator = self._generator() if self._generator is not None else None
        for name in ("_generation_batch", "_prompt_batch"):
            batch = getattr(generator, name, None)
            uids = list(getattr(batch, "uids", None) or ())
            if uid in uids:
                return list(batch.prompt_cache), uids.index(uid)
        return None

    def _plain_generator(self) -> bool:
        """A generator is attached and it has no draft model (``SpeculativeGenerationBatch``
        reports no fed ids, and its caches hold draft rows it may roll back)."""
        generator = self._generator() if self._generator is not None else None
        return generator is not None and getattr(generator, "draft_model", None) is None

    def _active_uids(self) -> set[Any] | None:
        generator = self._generator() if self._generator is not None else None
        if generator is None:
            return None
        active = set(getattr(getattr(generator, "_generation_batch", None), "uids", ()) or ())
        prompt_batch = getattr(generator, "_prompt_batch", None)
        if prompt_batch is not None:
            active.update(prompt_batch.uids)
        return active

    # ------------------------------------------------------------------ lent buffers

    def _may_lend(self, plan: RestorePlan) -> bool:
        """A lone-request loan is possible: a RAM entry restored at its own head, whose
        adopted buffer already has room for the suffix and the decode reserve."""
        if not self.copyfree.lending or plan.checkpoint is not None or plan.entry is None:
            return False
        if plan.entry.is_anchor or plan.length != plan.entry.length:
            return False
        if not self._plain_generator():
            return False
        rows_needed = plan.prompt_len + self.copyfree.decode_reserve
        return lending.lendable(plan.entry.kv, plan.length, rows_needed)

    def _may_rewind(self, plan: RestorePlan) -> bool:
        """A prompt that restores at an entry's protected prompt end (it did not re-render the
        reply) would be lent the buffer if the head sat there: the flow may rewind the entry
        (give up the reply's state, ``LineageCache.rewind``) so the turn appends in place as it
        would without reply reuse instead of copying the entry."""
        entry = plan.entry
        assert entry is not None
        if not self.copyfree.lending or entry.is_anchor or not isinstance(entry.kv, MlxKV) or entry.kv.lent:
            return False
        if not self._plain_generator():
            return False
        return entry.kv.capacity("keys") >= plan.prompt_len + self.copyfree.decode_reserve

    def commit(self, prompt_cache, token_ids, *, batch_idx=None, extra_hash=0,
               skip_first_n_tokens=0, blocks_in_use=()) -> bool:
        if self.runtime is None:
            return super().commit(prompt_cache, token_ids, batch_idx=batch_idx, extra_hash=extra_hash,
                                  skip_first_n_tokens=skip_first_n_tokens, blocks_in_use=blocks_in_use)
        # Entries are committed at the prefill end by store_checkpoint; nothing is left to do.
        self.manager.release(blocks_in_use)
        return False

    def _flow(self, pending: Pending) -> Admission:
        """The request flow of a pending prompt, at its admitted plan (captures, commits)."""
        assert self.runtime is not None
        return Admission(self.runtime.cache, pending.tokens, pending.namespace or "", pending.plan)

    def _unlooked(self, prompt: np.ndarray) -> Pending:
        """A prompt that skipped lookup: planned as cold, its namespace named by its first store."""
        assert self.runtime is not None
        pending = Pending(prompt, None, cold(RestorePlan(0, "cold", prompt_len=int(prompt.shape[0]))))
        self._pending.remember(pending)
        return pending


@dataclass
class _Loader:
    """The disk store as the flow's ``DiskLoader``: the loaded entry, or None and why (the
    store counts its rejects by reason)."""

    disk: Any

    def load(self, record: Any) -> tuple[Any, str]:
        before = Counter(getattr(self.disk, "rejects", {}))
        entry = self.disk.load(record)
        if entry is not None:
            return entry, ""
        return None, ",".join(sorted(Counter(getattr(self.disk, "rejects", {})) - before)) or "failed validation"


def _key_of(meta: dict) -> RequestKey:
    """The request key of a lookup answer or a row's metadata (both carry ``extra_hash``)."""
    return request_key(namespace_of(meta.get("extra_hash", 0)), as_tokens(meta["full_input_ids"]))
