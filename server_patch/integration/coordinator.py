"""mlx-vlm's APC coordinator, with the lineage cache behind its checkpoint-mode verbs.

0.7.10's batch generator already does the hard part: it asks the coordinator for a lookup at
admission, for the lengths where prefill must stop, calls ``store_checkpoint`` exactly when a
row has processed each length, and merges restored rows into the batch. We answer those calls
from the lineage policy:

* ``lookup``: the policy's restore point, built as truncated views (no restore clone);
* ``checkpoint_lengths``: the policy's captures (anchor, divergence, periodic, guard,
  segments) plus the prefill end n-1, where the entry is committed;
* ``store_checkpoint``: a capture takes references to the snapshot layers only; the prefill
  end extracts the row once and commits the entry (absorbing what it extends).

Block-mode (pure attention) models keep stock behaviour.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
from mlx_vlm.apc_coordinator import APCCoordinator

from server_patch.integration.anchors import REGISTRY as ANCHORS
from server_patch.integration.runtime import LineageRuntime, runtime_for
from server_patch.lineage import ANCHOR, RestorePlan, as_tokens
from server_patch.state import rows

log = logging.getLogger("server_patch.lineage")

_PENDING_MAX = 256


def prompt_key(tokens: np.ndarray) -> tuple[int, int]:
    return int(tokens.shape[0]), hash(tokens.tobytes())


@dataclass
class Pending:
    """A prompt between lookup and commit: its plan, captures asked for, captures taken."""

    tokens: np.ndarray
    namespace: str
    plan: RestorePlan
    final: int = 0
    wanted: dict[int, str] = field(default_factory=dict)
    taken: dict[int, tuple[str, Any]] = field(default_factory=dict)
    anchor_label: str = ""


class LineageCoordinator(APCCoordinator):
    """APCCoordinator whose checkpoint mode is the lineage cache."""

    def __init__(self, manager: Any, model: Any) -> None:
        super().__init__(manager, model)
        self.runtime: LineageRuntime | None = None
        if self.enabled and self.is_checkpoint:
            language_model = getattr(model, "language_model", model)
            self.runtime = runtime_for(manager, language_model)
        self._pending: OrderedDict[tuple[int, int], Pending] = OrderedDict()
        self._pending_lock = threading.Lock()

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
        key = prompt_key(prompt)
        namespace = str(extra_hash)
        record = self.runtime.timings.open(key, int(prompt.shape[0]))
        plan = cache.lookup(prompt, namespace)
        origin = plan
        if plan.tier == "disk" and self.runtime.disk is not None:
            loaded = self.runtime.disk.load(plan.record)
            cache.promote(plan.record, loaded)
            plan = cache.lookup(prompt, namespace)
        warm = None
        if plan.hit and plan.length >= safe_lookup_min and suffix_is_text_only(plan.length):
            try:
                warm = layout.build(plan.entry.kv, plan.state, plan.length)
            except Exception as exc:  # fail closed: a cold prefill, never garbage
                log.warning("apc_lineage restore of %s at %d failed: %s", plan.entry.id, plan.length, exc)
        self._remember(key, Pending(prompt, namespace, plan if warm is not None else _cold(plan)))
        record.lookup_ms = (time.perf_counter() - start) * 1000
        if warm is None:
            cache.note_cold(plan)
            return None
        cache.note_restore(plan)
        record.restore_kind = "disk" if origin.tier == "disk" else plan.kind
        record.restored_tokens = plan.length
        record.entry_id = plan.entry.id
        record.admission_ms = record.lookup_ms
        return {"matched_blocks": [], "warm_cache": warm, "prefix_len": plan.length,
                "extra_hash": extra_hash, "full_input_ids": list(token_ids), "cache_plan": self.plan}

    def merge_rows(self, picks: Sequence[Optional[dict]], prefix_lens: Sequence[int], *,
                   kv_quant_config: Optional[dict] = None):
        start = time.perf_counter()
        result = super().merge_rows(picks, prefix_lens, kv_quant_config=kv_quant_config)
        if self.runtime is not None:
            merge_ms = (time.perf_counter() - start) * 1000
            for pick in picks:
                if pick is None:
                    continue
                record = self.runtime.timings.by_key(prompt_key(as_tokens(pick["full_input_ids"])))
                if record is not None:
                    record.admission_ms += merge_ms
        return result

    def bind_rows(self, uids: Sequence[Any], metas: Sequence[Optional[dict]]) -> None:
        """Tie each row's timing record to the generator's uid (called when a batch is built)."""
        if self.runtime is None or not metas:
            return
        for uid, meta in zip(uids, metas):
            if meta is not None and "full_input_ids" in meta:
                self.runtime.timings.bind(uid, prompt_key(as_tokens(meta["full_input_ids"])))

    # ------------------------------------------------------------------ captures

    def checkpoint_lengths(self, token_ids: Sequence[int], media_token_ids: set[int]) -> list[int]:
        if self.runtime is None:
            return super().checkpoint_lengths(token_ids, media_token_ids)
        final = self.checkpoint_len(token_ids, media_token_ids)
        if final <= 0:
            return []
        prompt = as_tokens(token_ids)
        pending = self._pending_for(prompt)
        pending.final = final
        if media_token_ids and np.isin(prompt, list(media_token_ids)).any():
            return [final]  # checkpoints inside media regions are not text-aligned: final only
        boundary = ANCHORS.boundary(prompt)
        anchor_len = boundary[0] if boundary else None
        pending.anchor_label = boundary[1] if boundary else ""
        captures = self.runtime.cache.plan_captures(prompt, pending.plan, namespace=pending.namespace,
                                                    anchor_len=anchor_len)
        pending.wanted = {c.length: c.kind for c in captures if c.length <= final}
        return sorted({*pending.wanted, final})

    def store_checkpoint(self, token_ids: Sequence[int], prompt_cache: Sequence[Any], *,
                         extra_hash: int = 0, batch_idx: Optional[int] = None, uid: Any = None) -> bool:
        if self.runtime is None:
            return super().store_checkpoint(token_ids, prompt_cache, extra_hash=extra_hash,
                                            batch_idx=batch_idx)
        prefix = as_tokens(token_ids)
        length = int(prefix.shape[0])
        matches = self._pending_matching(prefix)
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
        kv, head = rows.extract(runtime.layout, prompt_cache, batch_idx, pending.final)
        if pending.wanted.get(pending.final) == ANCHOR:
            pending.taken[pending.final] = (ANCHOR, head)
        entry = runtime.cache.commit(pending.tokens, kv=kv, head=head, captures=pending.taken,
                                     namespace=pending.namespace, anchor_label=pending.anchor_label)
        key = prompt_key(pending.tokens)
        with self._pending_lock:
            self._pending.pop(key, None)
        timings = runtime.timings
        record = timings.by_uid(uid) if uid is not None else timings.by_key(key)
        if record is not None:
            record.commit_ms = (time.perf_counter() - start) * 1000
            record.captures = [f"{kind}@{n}" for n, (kind, _) in sorted(pending.taken.items())]
        return entry is not None

    def commit(self, prompt_cache, token_ids, *, batch_idx=None, extra_hash=0,
               skip_first_n_tokens=0, blocks_in_use=()) -> bool:
        if self.runtime is None:
            return super().commit(prompt_cache, token_ids, batch_idx=batch_idx, extra_hash=extra_hash,
                                  skip_first_n_tokens=skip_first_n_tokens, blocks_in_use=blocks_in_use)
        # Entries are committed at the prefill end by store_checkpoint; nothing is left to do.
        self.manager.release(blocks_in_use)
        return False

    # ------------------------------------------------------------------ pending prompts

    def _remember(self, key: tuple[int, int], pending: Pending) -> None:
        with self._pending_lock:
            self._pending[key] = pending
            self._pending.move_to_end(key)
            while len(self._pending) > _PENDING_MAX:
                self._pending.popitem(last=False)

    def _pending_for(self, prompt: np.ndarray) -> Pending:
        key = prompt_key(prompt)
        with self._pending_lock:
            pending = self._pending.get(key)
        if pending is None:  # a path that skipped lookup: plan as cold from what is stored
            assert self.runtime is not None
            plan = self.runtime.cache.lookup(prompt)
            pending = Pending(prompt, "0", _cold(plan))
            self._remember(key, pending)
        return pending

    def _pending_matching(self, prefix: np.ndarray) -> list[Pending]:
        length = int(prefix.shape[0])
        with self._pending_lock:
            candidates = list(self._pending.values())
        return [p for p in candidates
                if (length in p.wanted or length == p.final) and p.tokens.shape[0] >= length
                and np.array_equal(p.tokens[:length], prefix)]


def _cold(plan: RestorePlan) -> RestorePlan:
    return RestorePlan(0, "cold", shared=plan.shared, prompt_len=plan.prompt_len)

