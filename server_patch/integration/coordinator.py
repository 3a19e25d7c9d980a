"""mlx-vlm's APC coordinator, with the lineage cache behind its checkpoint-mode verbs.

0.7.10's batch generator already does the hard part: it asks the coordinator for a lookup at
admission, for the lengths where prefill must stop, calls ``store_checkpoint`` exactly when a
row has processed each length, and merges restored rows into the batch. This class is the
adapter that answers those verbs; the decisions are made elsewhere:

* ``lookup``: the request flow (``lineage.flow.Admission``, the simulator's too) plans until
  the plan is stable, with the disk tier as its loader and ``BatchRows.settle`` as its sweep
  (deferred entries committed, loans of the rows it needs ended). The restore is built as
  truncated views, or the entry's own buffer is lent to a lone request
  (``integration.batch_rows``); anything that fails to build is a cold prefill.
* ``merge_rows``: the one copy of a warm turn, into batch buffers with room for the suffix
  and a decode reserve, or none for a lent buffer (``copyfree.merge``).
* ``checkpoint_lengths`` / ``store_checkpoint``: the pending prompt's captures and its
  commit at the prefill end n - 1 (``integration.prefill``), deferred or copied out by
  ``BatchRows.prefill_end``; with reply reuse (``APC_LINEAGE_REPLY_REUSE``) its entry moves
  past the reply when the row leaves the batch.
* the generator's hooks (rows decoded, leaving, joining, removed; ``copyfree.hooks``) go to
  ``BatchRows``.

Every request is one record (``integration.session.Session``: its pending prompt, loan,
deferral, reply and timing record, and its ``SessionState``), named by the generator's uid from the
queue to its end: ``lookup`` gets it from mlx-vlm (the ``lineage.lookup_uid`` edit) and hands
the row on in its answer (``ROW``) to ``merge_rows``; identical prompts, of one tenant or two,
are separate records. Each verb and hook here is one transition of it.
Block-mode (pure attention) models keep stock behaviour. ``APC_COPYFREE=0`` keeps the stock
merge and commits every entry by an immediate copy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
from mlx_vlm.apc_coordinator import APCCoordinator

from server_patch.failclosed import fail_closed
from server_patch.copyfree import pool
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.integration import waits
from server_patch.integration.batch_rows import BatchRows
from server_patch.integration.generator import GeneratorView, RowBatch
from server_patch.integration.loading import DiskLoads
from server_patch.integration.pending import Pending, RequestKey, namespace_of, request_key
from server_patch.integration.prefill import Prefills
from server_patch.integration.session import WAITING, SessionBook, Session
from server_patch.integration.runtime import LineageRuntime, runtime_for
from server_patch.lineage import DISK, as_tokens
from server_patch.lineage.flow import Admission
from server_patch.lineage.misses import Lost

log = logging.getLogger("server_patch.lineage")

ROW = "apc_row"  # a lookup answer's key for the request's row (mlx-vlm hands the answer to ``merge_rows``)


@dataclass(frozen=True)
class _Lineage:
    """The lineage cache's parts for one model: built together, or not at all (stock APC)."""

    runtime: LineageRuntime
    book: SessionBook  # the runtime's one book, in this coordinator's scope (``integration.session``)
    prefills: Prefills
    rows: BatchRows
    loads: DiskLoads  # queued prompts whose disk restore points load meanwhile


class LineageCoordinator(APCCoordinator):
    """APCCoordinator whose checkpoint mode is the lineage cache."""

    def __init__(self, manager: Any, model: Any, *, runtime: LineageRuntime | None = None) -> None:
        """``runtime``: the model's lineage runtime (default: the one of ``manager``, made on
        first use; the row-machine tests hand in a light one)."""
        super().__init__(manager, model)
        self.copyfree: CopyFreeSettings = pool.configure()
        self.generator = GeneratorView()
        self.lineage: _Lineage | None = None
        if self.enabled and self.is_checkpoint:
            if runtime is None:
                language_model = getattr(model, "language_model", model)
                model_dir = getattr(model, "model_path", None) or getattr(language_model, "_apc_model_path", None)
                runtime = runtime_for(manager, language_model, model_dir)
            book = runtime.book.scope()  # the runtime's one book, in this coordinator's scope of uids
            prefills = Prefills(runtime, book)
            rows = BatchRows(runtime, self.copyfree, self.generator, prefills, book)
            self.lineage = _Lineage(runtime, book, prefills, rows, DiskLoads(runtime, book, rows=rows))

    @property
    def runtime(self) -> LineageRuntime | None:
        """The model's lineage runtime; None where stock APC serves (block mode, APC off)."""
        return self.lineage.runtime if self.lineage is not None else None

    def attach_generator(self, generator: Any) -> None:
        """The batch generator this coordinator serves (weakly): who else is decoding."""
        self.generator.attach(generator)

    def close(self) -> None:
        """mlx-vlm is done with this coordinator (its batch generator closed, or its
        single-sequence call ended): no event of its rows will come, so its scope of the book
        is closed (``SessionBook.close``). Each session not over ends by the event nobody saw:
        one waiting in the queue left it (``DiskLoads.end_waiting``), any other left its batch
        unseen (``BatchRows.left_unseen``: its loan given back, a lone row's deferred state
        committed, a shared one's lost); then they all leave the book, their holds let go."""
        if (lineage := self.lineage) is None:
            return

        def ending(row: Session) -> None:
            if row.state in WAITING:
                lineage.loads.end_waiting(row)
            else:
                lineage.rows.left_unseen(row)

        if (closed := lineage.book.close(ending)) is not None:
            log.info("apc_lineage scope closed: %d sessions left the book", closed)

    # ------------------------------------------------------------------ admission

    def admissible(self, queue: list[Any], extra_hash_of: Callable[[dict[str, Any]], int], limit: int, *,
                   decoding: int = 0) -> int:
        """How many of mlx-vlm's queued sequences, from the first, to admit now (``queue`` is
        reordered in place: a prompt whose disk restore point still loads goes behind the
        others, its row LOADING, ``integration.loading``). ``extra_hash_of``: the generator's
        hash of a sequence's prompt kwargs; ``decoding``: the rows decoding meanwhile."""
        if (lineage := self.lineage) is None:
            return min(limit, len(queue))

        return lineage.loads.admissible(queue, _prompt_of(extra_hash_of), limit, idle=decoding == 0)

    def prefetch(self, queue: list[Any], extra_hash_of: Callable[[dict[str, Any]], int], limit: int, *, busy: bool,
                 blocked: bool) -> None:
        """Every step, admitting or not: the first queued prompts' disk loads and staged copies
        start (``DiskLoads.prefetch``); ``busy``: rows decode or a prompt batch prefills;
        ``blocked``: mlx-vlm admits nothing this step (the batch is full, or a prefill runs)."""
        if (lineage := self.lineage) is not None:
            lineage.loads.prefetch(queue, _prompt_of(extra_hash_of), limit, busy=busy, blocked=blocked)

    @waits.unit(waits.Work.RESTORE, waits.lookup)
    def lookup(self, token_ids: Sequence[int], *, extra_hash: int, safe_lookup_min: int,
               suffix_is_text_only: Callable[[int], bool],
               prefix_has_media: Callable[[int], bool], uid: Optional[int] = None) -> Optional[dict[str, Any]]:
        """``uid``: mlx-vlm's id of the queued sequence (None on the single-sequence path)."""
        if (lineage := self.lineage) is None:
            return super().lookup(token_ids, extra_hash=extra_hash, safe_lookup_min=safe_lookup_min,
                                  suffix_is_text_only=suffix_is_text_only,
                                  prefix_has_media=prefix_has_media)
        if lineage.book.refuses("lookup"):  # its generator closed (``close``): a cold prefill, no session
            return None
        start = time.perf_counter()
        prompt, namespace = as_tokens(token_ids), namespace_of(extra_hash)
        key = request_key(namespace, prompt)
        record = lineage.book.timings.open(int(prompt.shape[0]))
        rows = lineage.rows
        rows.sweep()
        reclaimed: set[str] = set()  # entries whose loans this lookup ended: never lent again now
        mine = lineage.book.queued(uid, key)  # its row, if it waited in the queue (or looked up before)
        earlier = mine.record if mine is not None else None  # a second lookup keeps the first's drift
        record.drift = earlier.drift if earlier is not None else lineage.runtime.drift_of(prompt, namespace)
        disk = lineage.loads.for_request(mine, record)  # None without a disk tier
        admission = Admission.admit(lineage.runtime.cache, prompt, namespace, disk=disk,
                                    settle=lambda plan: rows.settle(prompt, namespace, plan, reclaimed),
                                    disk_refused=lambda: lineage.runtime.refuses(DISK))
        if disk is not None:
            disk.tell(admission)
        plan = admission.plan
        assert plan is not None  # ``admit`` planned it
        if not lineage.book.lent_to(key) and plan.entry is not None and plan.entry.id not in reclaimed:
            plan = admission.rewind(rows.may_rewind)
        if plan.hit and lineage.runtime.refuses(plan.kind):  # a failed canary check (ON_FAIL=cold): cold
            plan = admission.refuse(Lost.CANARY)
        warm, lease = None, None
        if plan.hit and plan.length >= safe_lookup_min and suffix_is_text_only(plan.length):
            try:
                warm, lease = rows.restore(mine, key, plan, reclaimed)
            except Exception as exc:  # fail closed: a cold prefill, never garbage (a lent entry raises)
                entry_id = plan.entry.id if plan.entry is not None else "?"  # a hit restores an entry
                fail_closed(exc, f"apc_lineage restore of {entry_id} at {plan.length}", log=log)
        if warm is None:  # a lent entry's rows are a loan in the way; media, a failed build: other
            admission.refuse(Lost.LOAN if plan.entry is not None and plan.entry.lent else Lost.OTHER)
        assert admission.plan is not None  # ``admit`` planned it; ``refuse`` and ``rewind`` replan
        row = lineage.book.admit(Pending(prompt, namespace, admission.plan, admission=admission), record,
                                 lease, uid=uid)
        if lease is not None:  # lent before its row was named: the row's hold from now on
            lineage.runtime.cache.own(lease.loan, row)
        lineage.loads.release(mine)  # admitted: the entry its file became is held no more
        record.lookup_ms = (time.perf_counter() - start) * 1000
        if warm is None:
            admission.cold()
            miss = admission.miss
            assert miss is not None  # ``cold`` explained it
            record.oracle, record.lost, record.lost_why = miss.oracle, miss.lost, miss.detail
            return None
        kv_admission = rows.admission_of(row, lease)
        admission.restored(kv_admission)
        miss = admission.miss
        assert miss is not None and plan.entry is not None  # ``restored`` explained it; a warm row has its entry
        record.oracle, record.lost, record.lost_why = miss.oracle, miss.lost, miss.detail
        record.restore_kind = DISK if admission.tier == DISK else plan.kind
        record.restored_tokens, record.entry_id = plan.length, plan.entry.id
        record.kv_admission, record.admission_ms = kv_admission, record.lookup_ms
        return {"matched_blocks": [], "warm_cache": warm, "prefix_len": plan.length,
                "extra_hash": extra_hash, "full_input_ids": list(token_ids), "cache_plan": self.plan,
                ROW: row}

    def merge_rows(self, picks: Sequence[Optional[dict[str, Any]]], prefix_lens: Sequence[int], *,
                   kv_quant_config: Optional[dict[str, Any]] = None) -> tuple[Optional[list[Any]], int]:
        lineage = self.lineage
        if lineage is None:
            return super().merge_rows(picks, prefix_lens, kv_quant_config=kv_quant_config)
        start = time.perf_counter()
        found = [p.get(ROW) if p is not None else None for p in picks]
        result: Optional[tuple[Optional[list[Any]], int]] = None
        if self.copyfree.enabled and kv_quant_config is None:
            result = self._merge_copyfree(lineage.rows, picks, found, prefix_lens)
        if result is None:
            result = super().merge_rows(picks, prefix_lens, kv_quant_config=kv_quant_config)
        merge_ms = (time.perf_counter() - start) * 1000
        for row in found:
            if row is not None and row.record is not None:
                row.record.admission_ms += merge_ms
        return result

    def _merge_copyfree(self, rows: BatchRows, picks: Sequence[Optional[dict[str, Any]]],
                        found: Sequence[Optional[Session]],
                        prefix_lens: Sequence[int]) -> Optional[tuple[list[Any], int]]:
        """One copy per restored row, into buffers sized for prefix + suffix + reserve."""
        memory = self.manager.memory_plan
        if len(prefix_lens) == len(memory.lengths):
            totals = list(memory.lengths)
            self.prepare_prefill(totals, prefill_step_size=memory.chunk_size, prefix_lengths=prefix_lens)
        else:  # cold rows' lengths unknown: they may regrow once, warm rows never do
            totals = [len(p["full_input_ids"]) if p else n for p, n in zip(picks, prefix_lens)]
        suffixes = [max(0, total - n) for total, n in zip(totals, prefix_lens)]
        row_caches = [p["warm_cache"] if p is not None else self.fresh_cache() for p in picks]
        caches = rows.merge(found, row_caches, prefix_lens, suffixes)
        if caches is None:
            return None
        with self.manager.lock:
            self.manager.stats.restored_tokens += sum(prefix_lens)
        return caches, max(prefix_lens) if prefix_lens else 0

    def bind_rows(self, uids: Sequence[int], metas: Sequence[Optional[dict[str, Any]]]) -> None:
        """Each row of a prompt batch just built is PREFILLING (found by its uid; a row looked
        up without one is named by it here); a prompt restored at its own prompt end is at
        its prefill end already, its reply tracked."""
        if (lineage := self.lineage) is None or not metas:
            return
        for uid, meta in zip(uids, metas):
            if meta is not None and "full_input_ids" in meta:
                row = lineage.book.bind(_key_of(meta), uid)
                if row is not None and lineage.prefills.resend(row):
                    lineage.rows.resent(row, uid)

    # ------------------------------------------------------------------ captures and commits

    def checkpoint_lengths(self, token_ids: Sequence[int], media_token_ids: set[int]) -> list[int]:
        if (lineage := self.lineage) is None:
            return super().checkpoint_lengths(token_ids, media_token_ids)
        final = self.checkpoint_len(token_ids, media_token_ids)
        return lineage.prefills.lengths(token_ids, media_token_ids, final) if final > 0 else []

    def store_checkpoint(self, token_ids: Sequence[int], prompt_cache: Sequence[Any], *,
                         extra_hash: int = 0, batch_idx: Optional[int] = None, uid: Optional[int] = None) -> bool:
        if (lineage := self.lineage) is None:
            return super().store_checkpoint(token_ids, prompt_cache, extra_hash=extra_hash,
                                            batch_idx=batch_idx)
        took, ending = lineage.prefills.take(token_ids, prompt_cache, extra_hash, batch_idx, uid)
        committed = [lineage.rows.prefill_end(row, prompt_cache, batch_idx, uid) for row in ending]
        return any(committed) or took

    def commit(self, prompt_cache: Sequence[Any], token_ids: Sequence[int], *, batch_idx: Optional[int] = None,
               extra_hash: int = 0, skip_first_n_tokens: int = 0, blocks_in_use: Sequence[Any] = ()) -> bool:
        if self.lineage is None:
            return super().commit(prompt_cache, token_ids, batch_idx=batch_idx, extra_hash=extra_hash,
                                  skip_first_n_tokens=skip_first_n_tokens, blocks_in_use=blocks_in_use)
        # Entries are committed at the prefill end by store_checkpoint; nothing is left to do.
        self.manager.release(blocks_in_use)
        return False

    # ------------------------------------------------------------------ the generator's hooks

    def rows_decoded(self, batch: RowBatch, tokens: Sequence[int]) -> None:
        """``GenerationBatch.next``: ``tokens[i]`` was just fed to row ``batch.uids[i]``."""
        if self.lineage is not None:
            self.lineage.book.decoded(list(batch.uids), tokens)

    def rows_leaving(self, batch: Any, keep: Sequence[int]) -> None:
        """``GenerationBatch.filter``: rows not in ``keep`` stop writing their caches now."""
        if self.lineage is not None:
            self.lineage.rows.leaving(batch, keep)

    def speculative_round(self, batch: Any, verify_input: Any, accepted: Sequence[int],
                          active: Sequence[int]) -> None:
        """A speculative batch committed a round: what each row's cache kept."""
        if self.lineage is not None:
            self.lineage.rows.verified_round(batch, verify_input, accepted, active)

    def speculative_rows_leaving(self, batch: Any, uids: Sequence[int]) -> None:
        """Rows of a speculative batch finished: they stop writing their caches now."""
        if self.lineage is not None:
            self.lineage.rows.verified_leaving(batch, uids)

    def batches_joining(self, existing: Any, incoming: Any) -> None:
        """Before ``existing.extend(incoming)``: lone rows' buffers are about to be replaced."""
        if self.lineage is not None:
            self.lineage.rows.joining(existing, incoming)

    def request_removed(self, uid: int) -> None:
        """A request is taken out of the prompt batch mid-prefill."""
        if self.lineage is not None:
            self.lineage.rows.removed(uid)

    # ------------------------------------------------------------------ the server's request events

    def prefill_completed(self, uid: int, request_id: object, prompt_time_s: float) -> None:
        """The row's prefill ended (the server's prompt-time report): its restore line."""
        if self.lineage is not None:
            self.lineage.book.prefill_completed(uid, request_id, prompt_time_s)

    def first_token(self, uid: int, request_id: object, ttft_s: float) -> None:
        """The row's first token reached its client: its record is finished."""
        if self.lineage is not None:
            self.lineage.book.first_token(uid, request_id, ttft_s)

    def cancelled(self, uid: int, request_id: object, queued_tokens: int | None) -> None:
        """The request was cancelled and the generator let it go; ``queued_tokens``: its
        prompt length if it was still queued (it never reached a lookup), else None."""
        if (lineage := self.lineage) is None:
            return
        if queued_tokens is not None:
            lineage.book.timings.cancelled_queued(request_id, queued_tokens)
            lineage.runtime.cache.note_cancelled_queued()
        else:
            lineage.book.cancelled(uid, request_id)


def _prompt_of(extra_hash_of: Callable[[dict[str, Any]], int]) -> Callable[[Sequence[Any]], tuple[np.ndarray, str]]:
    """A queued sequence's tokens and namespace (``extra_hash_of``: the generator's hash of its
    prompt kwargs)."""
    # mlx-vlm's queued sequence (uid, ids, max_tokens, prompt_kwargs, ...): an untyped tuple.
    def prompt_of(sequence: Sequence[Any]) -> tuple[np.ndarray, str]:
        return as_tokens(sequence[1]), namespace_of(extra_hash_of(sequence[3] or {}))

    return prompt_of


def _key_of(meta: dict[str, Any]) -> RequestKey:
    """The request key of a lookup answer or a row's metadata (both carry ``extra_hash``)."""
    return request_key(namespace_of(meta.get("extra_hash", 0)), as_tokens(meta["full_input_ids"]))
