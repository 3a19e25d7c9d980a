"""mlx-vlm's APC coordinator, with the lineage cache behind its checkpoint-mode verbs.

0.7.10's batch generator already does the hard part: it asks the coordinator for a lookup at
admission, for the lengths where prefill must stop, calls ``store_checkpoint`` exactly when a
row has processed each length, and merges restored rows into the batch. We answer those calls
from the lineage policy:

* ``lookup``: the policy's restore point, built as truncated views (no restore clone). It
  plans until the plan is stable (deferred entries committed, loans of the rows it needs
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
  by a copy, so deferral never hides a restore point.

Reply reuse (``APC_LINEAGE_REPLY_REUSE``, on by default): a row of the batched, non-speculative
path is tracked from its prefill end (``server_patch.copyfree.replies``: the ids each decode
step fed). When it leaves the decoding batch (finished, stopped, length, cancelled) and its
caches provably hold prompt + exactly those ids, its entry's head moves past the reply
(``LineageCache.commit_reply``): a lone row's buffer is adopted as it is (the reply's KV rows
are already in it), a row of a multi-row batch is copied out once. The prompt end stays the
entry's protected checkpoint; anything that does not check out leaves the entry there. A
prompt that restores at that point and could be lent the buffer rewinds the entry to it first
(``_rewound``). Off by explicit check: the single-sequence path (no uid, no decode hook),
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
from server_patch.copyfree import pool, replies
from server_patch.copyfree import lease as lending
from server_patch.copyfree import merge as copyfree_merge
from server_patch.copyfree.lease import Lease
from server_patch.copyfree.replies import Reply, ReplyBook
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.integration import segments as SEGMENTS
from server_patch.integration.pending import Pending, PendingBook, RequestKey, namespace_of, request_key
from server_patch.integration.runtime import LineageRuntime, runtime_for
from server_patch.lineage import ANCHOR, DISK, RestorePlan, as_tokens
from server_patch.state import rows
from server_patch.state.layout import MlxKV

log = logging.getLogger("server_patch.lineage")

# Plans a lookup may make before it settles (each re-plan follows progress: a deferred entry
# committed, a loan ended, a disk file loaded or rejected); past that it prefills cold.
_PLANS_MAX = 8


@dataclass
class Deferred:
    """An entry whose KV rows are still being written by their own request: a lone row
    (``caches``: its own buffers), or with reply reuse a row sharing its batch (``shared``:
    found by uid in the decoding batch when needed, and copied out once when it ends)."""

    pending: Pending
    head: Any
    caches: list[Any]
    uid: Any
    since: float
    shared: bool = False


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
        self._deferred: dict[Any, Deferred] = {}
        self._leases: dict[RequestKey, Lease] = {}
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
        plan, promoted, reclaimed = self._settled_plan(prompt, namespace)
        if key not in self._leases and plan.entry is not None and plan.entry.id not in reclaimed:
            plan = self._rewound(plan, prompt, namespace)
        if plan.hit and canary.refuses(plan.kind):  # a failed canary check (ON_FAIL=cold): cold
            plan = _cold(plan)
        warm = None
        lent = False
        if plan.hit and plan.length >= safe_lookup_min and suffix_is_text_only(plan.length):
            try:
                if key not in self._leases and plan.entry.id not in reclaimed and self._may_lend(plan):
                    warm = lending.lend(layout, plan.entry.kv, plan.state, plan.length)
                    self._leases[key] = Lease(plan.entry, key, list(warm))
                    lent = True
                else:
                    warm = layout.build(plan.entry.kv, plan.state, plan.length)  # raises if lent
            except Exception as exc:  # fail closed: a cold prefill, never garbage
                log.warning("apc_lineage restore of %s at %d failed: %s", plan.entry.id, plan.length, exc)
        self._pending.remember(Pending(prompt, namespace, plan if warm is not None else _cold(plan)))
        record.lookup_ms = (time.perf_counter() - start) * 1000
        if warm is None:
            cache.note_cold(plan)
            return None
        admission = "lent" if lent else "copied"
        cache.note_restore(plan, admission)
        record.restore_kind = DISK if plan.entry.id in promoted else plan.kind
        record.restored_tokens = plan.length
        record.entry_id = plan.entry.id
        record.kv_admission = admission
        record.admission_ms = record.lookup_ms
        return {"matched_blocks": [], "warm_cache": warm, "prefix_len": plan.length,
                "extra_hash": extra_hash, "full_input_ids": list(token_ids), "cache_plan": self.plan}

    def _settled_plan(self, prompt: np.ndarray, namespace: str) -> tuple[RestorePlan, set[str], set[str]]:
        """Plan until the plan is stable, so the one admitted has been swept like the first:
        deferred entries it would restore from are committed, loans of its rows end, a disk
        restore point is loaded (or its file rejected), and after each of these it plans
        again. Returns (plan, ids of entries loaded from disk, ids of entries reclaimed)."""
        assert self.runtime is not None
        cache, disk = self.runtime.cache, self.runtime.disk
        promoted: set[str] = set()
        reclaimed: set[str] = set()
        loaded_ids: set[str] = set()
        if len(self._replies):
            active = self._active_uids()
            if active is not None:
                self._replies.sweep(active)
        plan = cache.lookup(prompt, namespace)
        for _ in range(_PLANS_MAX):
            if self._deferred and self._surface_deferred(prompt, namespace, plan.length):
                pass  # a deferred entry was committed: there may be a longer restore point
            elif self._leases and self._sweep_leases(plan, reclaimed):
                pass  # an entry was dropped: plan again
            elif plan.tier == DISK and (disk is None or plan.record.id in loaded_ids or canary.refuses(DISK)):
                break  # loaded once already and gone again (no room in RAM), or a suspect tier: cold
            elif plan.tier == DISK:
                loaded_ids.add(plan.record.id)
                loaded, why = _load(disk, plan.record)
                if cache.promote(plan.record, loaded, reason=why) is not None:
                    promoted.add(plan.record.id)
            else:
                return plan, promoted, reclaimed
            plan = cache.lookup(prompt, namespace)
        else:
            log.warning("apc_lineage lookup did not settle after %d plans: cold prefill", _PLANS_MAX)
        return _cold(plan), promoted, reclaimed

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
                self._end_lease(lease, reason="batch")
        headroom = self.copyfree.lend_headroom if len(picks) == 1 and self.copyfree.lending else 0
        caches = copyfree_merge.merge_rows(row_caches, prefix_lens, suffixes, self.copyfree.decode_reserve,
                                           headroom=headroom, lend=lone is not None)
        if caches is None:
            if lone is not None:
                self._end_lease(lone, reason="fallback")
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
                lease = self._leases.get(key)
                if lease is not None and lease.uid is None:
                    lease.uid = uid

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
        captures = self.runtime.cache.plan_captures(pending.tokens, pending.plan,
                                                    namespace=pending.namespace or "",
                                                    anchor_len=info.anchor_len, segments=info.segments)
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
            self._deferred[uid] = Deferred(pending, head, list(prompt_cache) if lone else [], uid,
                                           time.monotonic(), shared=not lone)
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
        entry = self.runtime.cache.commit(pending.tokens, kv=kv, head=head, captures=pending.taken,
                                          namespace=pending.namespace, anchor_label=pending.anchor_label)
        if self._leases:
            self._settle_leases()
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
        generator = self._generator() if self._generator is not None else None
        if generator is None or getattr(generator, "draft_model", None) is not None:
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
        """Move the row's entry past its reply: adopt a lone row's buffer (views), copy a
        shared batch's row once. False (nothing stored) if the row does not check out."""
        start = time.perf_counter()
        runtime = self.runtime
        assert runtime is not None
        fed = replies.validated(runtime.layout, reply, batch, idx)
        if fed is None:
            log.info("apc_lineage reply of %d tokens not kept: the row's cache does not hold prompt + "
                     "reply (entry stays at the prompt end)", len(reply.fed))
            return False
        pending, caches, length = reply.pending, list(batch.prompt_cache), reply.fed_length
        capacity = rows.buffer_rows(caches)
        adopt = alone and self.copyfree.enabled and self.copyfree.adopt and \
            self.copyfree.adoptable(length, capacity)
        captures = dict(pending.taken) if deferred is not None else {}  # else the stored entry has them
        if deferred is not None and pending.wanted.get(pending.final) == ANCHOR:
            captures[pending.final] = (ANCHOR, reply.prompt_head)
        try:
            kv = rows.kv_rows(runtime.layout, caches, idx, length, copy=not adopt)
            head = rows.capture(runtime.layout, caches, idx, length)
            runtime.cache.commit_reply(pending.tokens, fed, kv=kv, head=head, prompt_head=reply.prompt_head,
                                       captures=captures, namespace=pending.namespace or "",
                                       anchor_label=pending.anchor_label)
        except Exception as exc:  # fail closed: the prompt-end entry (or its deferral) stands
            log.warning("apc_lineage reply commit of %d tokens failed: %s", length, exc)
            return False
        if self._leases:
            self._settle_leases()
        elapsed = (time.perf_counter() - start) * 1000
        if reply.record is not None:
            reply.record.commit_ms += elapsed
            reply.record.reply_tokens = len(fed)
        if deferred is not None:  # the deferred entry's commit, past its reply
            log.info("apc_copyfree commit uid=%s mode=%s reason=end tokens=%d kv_bytes=%d buffer_rows=%d "
                     "deferred_s=%.2f ms=%.1f reply=%d", deferred.uid, "adopt" if adopt else "copy", length,
                     kv.nbytes, capacity, time.monotonic() - deferred.since, elapsed, len(fed))
        else:  # its entry was stored at the prompt end already (a join, a lookup surfaced it)
            log.info("apc_lineage reply kept uid=%s mode=%s tokens=%d kv_bytes=%d ms=%.1f reply=%d",
                     batch.uids[idx], "adopt" if adopt else "copy", length, kv.nbytes, elapsed, len(fed))
        return True

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
        generator = self._generator() if self._generator is not None else None
        if generator is None or getattr(generator, "draft_model", None) is not None:
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
            deferred = self._deferred.pop(uid, None)
            kept_reply = reply is not None and self._commit_reply(reply, batch, i, alone=alone,
                                                                  deferred=deferred)
            if deferred is not None and not kept_reply:
                self._resolve(deferred, list(batch.prompt_cache), i, adopt=alone, reason="end")
            self._end_lease_of(uid, batch.prompt_cache if alone else None, reason="end")

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
                    self._resolve(self._deferred.pop(uid), list(batch.prompt_cache), i, adopt=alone,
                                  reason="join")
                self._end_lease_of(uid, batch.prompt_cache if alone else None, reason="join")

    def request_removed(self, uid: Any) -> None:
        """A request is taken out of the prompt batch mid-prefill: its loan ends now, it will
        feed no reply, and a deferred row sharing the batch is committed now, while it is there."""
        self._replies.take(uid)
        deferred = self._deferred.get(uid)
        if deferred is not None and deferred.shared:
            found = self._row_of(uid)
            if found is not None:
                del self._deferred[uid]
                self._resolve(deferred, found[0], found[1], adopt=False, reason="removed")
        self._end_lease_of(uid, None, reason="removed")

    def _surface_deferred(self, prompt: np.ndarray, namespace: str, restorable: int) -> bool:
        """Commit deferred entries a lookup would restore from (or that nobody writes any more)."""
        active = self._active_uids()
        surfaced = False
        for uid, deferred in list(self._deferred.items()):
            orphan = active is not None and uid not in active
            useful = deferred.pending.namespace == namespace and \
                _best_restore(deferred.pending, prompt) > restorable
            if orphan:
                self._replies.take(uid)
            if orphan or useful:
                del self._deferred[uid]
                reason = "orphan" if orphan else "lookup"
                if not deferred.shared:
                    self._resolve(deferred, deferred.caches, 0, adopt=orphan, reason=reason)
                elif (found := self._row_of(uid)) is not None:
                    self._resolve(deferred, found[0], found[1], adopt=False, reason=reason)
                else:  # its row is gone and nothing saw it leave: no entry, never garbage
                    log.warning("apc_lineage deferred entry of %d tokens lost: its row left unseen",
                                deferred.pending.final)
                    continue
                surfaced = surfaced or useful
        return surfaced

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

    def _active_uids(self) -> set[Any] | None:
        generator = self._generator() if self._generator is not None else None
        if generator is None:
            return None
        active = set(getattr(getattr(generator, "_generation_batch", None), "uids", ()) or ())
        prompt_batch = getattr(generator, "_prompt_batch", None)
        if prompt_batch is not None:
            active.update(prompt_batch.uids)
        return active

    def _resolve(self, deferred: Deferred, caches: list[Any], idx: int, *, adopt: bool,
                 reason: str) -> None:
        """Commit a deferred entry: adopt the row's buffer (views) or copy the row."""
        start = time.perf_counter()
        runtime = self.runtime
        assert runtime is not None
        final = deferred.pending.final
        capacity = rows.buffer_rows(caches)
        adopt = adopt and self.copyfree.adoptable(final, capacity)
        try:
            kv = rows.kv_rows(runtime.layout, caches, idx, final, copy=not adopt)
            self._store(deferred.pending, kv, deferred.head)
        except Exception as exc:  # the row is gone (removed mid-prefill): no entry, never garbage
            log.warning("apc_lineage deferred commit of %d tokens dropped (%s): %s", final, reason, exc)
            return
        elapsed = (time.perf_counter() - start) * 1000
        record = runtime.timings.by_uid(deferred.uid)
        if record is not None:
            record.commit_ms += elapsed
        log.info("apc_copyfree commit uid=%s mode=%s reason=%s tokens=%d kv_bytes=%d buffer_rows=%d "
                 "deferred_s=%.2f ms=%.1f", deferred.uid, "adopt" if adopt else "copy", reason, final,
                 kv.nbytes, capacity, time.monotonic() - deferred.since, elapsed)

    # ------------------------------------------------------------------ lent buffers

    def _may_lend(self, plan: RestorePlan) -> bool:
        """A lone-request loan is possible: a RAM entry restored at its own head, whose
        adopted buffer already has room for the suffix and the decode reserve."""
        if not self.copyfree.lending or plan.checkpoint is not None or plan.entry is None:
            return False
        if plan.entry.is_anchor or plan.length != plan.entry.length:
            return False
        generator = self._generator() if self._generator is not None else None
        if generator is None or getattr(generator, "draft_model", None) is not None:
            return False
        rows_needed = plan.prompt_len + self.copyfree.decode_reserve
        return lending.lendable(plan.entry.kv, plan.length, rows_needed)

    def _rewound(self, plan: RestorePlan, prompt: np.ndarray, namespace: str) -> RestorePlan:
        """A prompt that restores at an entry's protected prompt end (it did not re-render the
        reply) would be lent the buffer if the head sat there: rewind the entry (give up the
        reply's state, ``LineageCache.rewind``) and plan again, so the turn appends in place
        as it would without reply reuse instead of copying the entry."""
        entry = plan.entry
        assert self.runtime is not None and entry is not None
        if plan.checkpoint is None or not entry.prompt_end or plan.length != entry.prompt_end:
            return plan
        if not self.copyfree.lending or entry.is_anchor or not isinstance(entry.kv, MlxKV) or entry.kv.lent:
            return plan
        generator = self._generator() if self._generator is not None else None
        if generator is None or getattr(generator, "draft_model", None) is not None:
            return plan
        if entry.kv.capacity("keys") < plan.prompt_len + self.copyfree.decode_reserve:
            return plan
        if not self.runtime.cache.rewind(entry):
            return plan
        again = self.runtime.cache.lookup(prompt, namespace)
        # The old plan stays buildable (its checkpoint's state, the truncated rows) if the
        # new one is not the rewound head (it always is while nothing else changed).
        return again if again.entry is entry and again.length == plan.length else plan

    def _sweep_leases(self, plan: RestorePlan, reclaimed: set[str]) -> bool:
        """Before a lookup builds anything: end loans whose rows this prompt needs, loans
        whose borrower is gone, and loans never merged (their batch was not a lone row).
        Returns True if an entry had to be dropped."""
        active = self._active_uids()
        dropped = False
        for lease in list(self._leases.values()):
            if plan.entry is lease.entry:
                reason = "shared"
                reclaimed.add(lease.entry.id)
            elif not lease.merged:
                reason = "unmerged"
            elif active is not None and lease.uid is not None and lease.uid not in active:
                reason = "orphan"
            else:
                continue
            dropped = not self._end_lease(lease, reason=reason) or dropped
        return dropped

    def _end_lease_of(self, uid: Any, caches: Optional[Sequence[Any]], *, reason: str) -> None:
        if uid is None:
            return
        for lease in [lease for lease in self._leases.values() if lease.uid == uid]:
            self._end_lease(lease, caches, reason=reason)

    def _end_lease(self, lease: Lease, caches: Optional[Sequence[Any]] = None, *, reason: str) -> bool:
        """Give the lent rows back to their entry (or drop the entry if they are gone)."""
        assert self.runtime is not None
        self._leases.pop(lease.key, None)
        cache = self.runtime.cache
        kept = lending.give_back(self.runtime.layout, lease, caches, still_stored=cache.holds)
        if not kept:
            cache.drop(lease.entry.id, "lent rows lost")
        log.info("apc_copyfree loan of entry %s ended: %s%s", lease.entry.id, reason,
                 "" if kept else " (entry dropped)")
        return kept

    def _settle_leases(self) -> None:
        """Loans whose entry was absorbed (by the borrower's own entry) or evicted are over:
        the buffer belongs to whoever writes it now."""
        assert self.runtime is not None
        for lease in list(self._leases.values()):
            if not self.runtime.cache.holds(lease.entry):
                del self._leases[lease.key]
                log.info("apc_copyfree loan of entry %s ended: absorbed", lease.entry.id)

    def commit(self, prompt_cache, token_ids, *, batch_idx=None, extra_hash=0,
               skip_first_n_tokens=0, blocks_in_use=()) -> bool:
        if self.runtime is None:
            return super().commit(prompt_cache, token_ids, batch_idx=batch_idx, extra_hash=extra_hash,
                                  skip_first_n_tokens=skip_first_n_tokens, blocks_in_use=blocks_in_use)
        # Entries are committed at the prefill end by store_checkpoint; nothing is left to do.
        self.manager.release(blocks_in_use)
        return False

    def _unlooked(self, prompt: np.ndarray) -> Pending:
        """A prompt that skipped lookup: planned as cold, its namespace named by its first store."""
        assert self.runtime is not None
        pending = Pending(prompt, None, _cold(RestorePlan(0, "cold", prompt_len=int(prompt.shape[0]))))
        self._pending.remember(pending)
        return pending


def _load(disk: Any, record: Any) -> tuple[Any, str]:
    """The loaded entry, or None and why (the disk store counts its rejects by reason)."""
    before = Counter(getattr(disk, "rejects", {}))
    entry = disk.load(record)
    if entry is not None:
        return entry, ""
    return None, ",".join(sorted(Counter(getattr(disk, "rejects", {})) - before)) or "failed validation"


def _key_of(meta: dict) -> RequestKey:
    """The request key of a lookup answer or a row's metadata (both carry ``extra_hash``)."""
    return request_key(namespace_of(meta.get("extra_hash", 0)), as_tokens(meta["full_input_ids"]))


def _best_restore(pending: Pending, prompt: np.ndarray) -> int:
    """The longest restore point a deferred entry (head at ``final``, its captures) offers."""
    common = _common_prefix(prompt, pending.tokens[:pending.final])
    lengths = [pending.final, *pending.taken]
    return max((n for n in lengths if n <= common and n < prompt.shape[0]), default=0)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(int(a.shape[0]), int(b.shape[0]))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _cold(plan: RestorePlan) -> RestorePlan:
    return RestorePlan(0, "cold", shared=plan.shared, prompt_len=plan.prompt_len)

