"""Entries committed once nothing writes their rows any more: deferred commits and reply commits.

At the prefill end a row alone in its batch is *deferred*: its snapshot is kept (references)
and its own KV buffer is adopted, truncated, once its request stops writing it (it leaves the
decoding batch, or its rows are concatenated into a shared batch). With reply reuse a row
sharing its batch is deferred too, found by uid when needed and copied out once when it ends.
A lookup that would restore from a deferred entry commits it first (``surfaces``), by a copy,
so deferral never hides a restore point. A request's deferral is its row's ``deferral``
(``integration.session``), and what it holds of the cache meanwhile is a hold (decision 0013):
a lone row's buffer one of kind ``DEFERRED``, the entry a shared row's reply will be appended to
one of kind ``BASE`` (``integration.batch_rows``); these are the mechanics.

When a tracked row ends and its cache provably holds prompt + the ids it was fed
(``replies.validated``), ``commit_reply`` moves its entry's head past the reply: a lone row's
buffer is adopted as it is, a row of a multi-row batch is copied out once.

The coordinator calls these on the generation thread, which is the only one writing caches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import numpy as np

from server_patch.copyfree import append as appending
from server_patch.copyfree import replies
from server_patch.copyfree.replies import Reply
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.failclosed import fail_closed
from server_patch.lineage import ANCHOR
from server_patch.lineage.lookup import common_prefix_len
from server_patch.state import rows
from server_patch.state.layout import CacheLayout, MlxKV, MlxSnapshot

if TYPE_CHECKING:
    from server_patch.integration.generator import RowBatch
    from server_patch.integration.pending import Pending
    from server_patch.lineage.policy import LineageCache

# The commit lines go to the lineage log (operators and tests read them there).
log = logging.getLogger("server_patch.lineage")


@dataclass
class Deferred:
    """An entry whose KV rows are still being written by their own request: a lone row
    (``caches``: its own buffers), or with reply reuse a row sharing its batch (``shared``:
    found by uid in the decoding batch when needed, and copied out once when it ends)."""

    pending: Pending  # the request's prompt
    head: MlxSnapshot  # the state at its prompt end
    caches: list[Any]  # a lone row's own per-layer caches (mlx-vlm's, untyped)
    uid: Optional[int]  # mlx-vlm's uid of its row
    since: float
    shared: bool = False
    stored: Optional[appending.Base] = None  # the entry its prompt-end commit stored (``resolve``)


class ReplyStore(Protocol):
    """Commits a row's state past its reply (the flow's ``commit_reply``)."""

    def __call__(self, pending: Pending, fed: np.ndarray, /, *, kv: MlxKV, head: MlxSnapshot,
                 prompt_head: MlxSnapshot, captures: dict[int, tuple[str, MlxSnapshot]]) -> object: ...


def resolve(layout: CacheLayout, settings: CopyFreeSettings, deferred: Deferred, caches: list[Any], idx: int, *,
            adopt: bool, reason: str, store: Callable[[Pending, MlxKV, MlxSnapshot], bool],
            room: int = 0) -> Optional[float]:
    """Commit a deferred entry: adopt the row's buffer (views) or copy the row (into buffers of
    ``room`` rows where its reply will be appended, ``append.copy_with_room``), then
    ``store(pending, kv, head)`` it at its prompt end. Returns the milliseconds it took, or
    None if the row was gone (removed mid-prefill: no entry, never garbage)."""
    start = time.perf_counter()
    final = deferred.pending.final
    capacity = rows.buffer_rows(caches)
    adopt = adopt and settings.adoptable(final, capacity) and not rows.kept_in_place(caches)
    try:
        kv = rows.kv_rows(layout, caches, idx, final, copy=False) if adopt else \
            appending.copy_with_room(layout, caches, idx, final, room)
        if store(deferred.pending, kv, deferred.head):
            deferred.stored = appending.Base(kv, final)
    except Exception as exc:  # the row is gone (removed mid-prefill): no entry, never garbage
        log.warning("apc_lineage deferred commit of %d tokens dropped (%s): %s", final, reason, exc)
        return None
    elapsed = (time.perf_counter() - start) * 1000
    log.info("apc_copyfree commit uid=%s mode=%s reason=%s tokens=%d kv_bytes=%d buffer_rows=%d "
             "deferred_s=%.2f ms=%.1f", deferred.uid, "adopt" if adopt else "copy", reason, final,
             kv.nbytes, capacity, time.monotonic() - deferred.since, elapsed)
    return elapsed


def surfaces(deferred: Deferred, prompt: np.ndarray, namespace: str, restorable: int) -> bool:
    """Whether a lookup of ``prompt`` would restore more from this deferred entry than the
    ``restorable`` tokens it restores now (so it is committed first: deferral never hides a
    restore point)."""
    return deferred.pending.namespace == namespace and best_restore(deferred.pending, prompt) > restorable


def commit_reply(layout: CacheLayout, settings: CopyFreeSettings, reply: Reply, batch: RowBatch, idx: int, *,
                 alone: bool, deferred: Optional[Deferred], store: ReplyStore,
                 settle: Callable[[], None], cache: Optional[LineageCache] = None) -> bool:
    """Move the row's entry past its reply: adopt a lone row's buffer (views); for a row of a
    shared batch append only the rows its entry lacks into that entry's buffer
    (``copyfree.append``, with ``cache`` the lineage cache), else copy the row once.
    ``store(pending, fed, kv=, head=, prompt_head=, captures=)`` commits it (the flow's
    ``commit_reply``); ``settle`` runs after a commit. False (nothing stored) if the row does
    not check out."""
    start = time.perf_counter()
    fed = replies.validated(layout, reply, batch, idx)
    if fed is None:
        log.info("apc_lineage reply of %d tokens not kept: the row's cache does not hold prompt + "
                 "reply (entry stays at the prompt end)", len(reply.fed))
        return False
    pending, caches, length = reply.pending, list(batch.prompt_cache), reply.fed_length
    capacity = rows.buffer_rows(caches)
    adopt = (alone and settings.enabled and settings.adopt and settings.adoptable(length, capacity)
             and not rows.kept_in_place(caches))
    captures = dict(pending.taken) if deferred is not None else {}  # else the stored entry has them
    if deferred is not None and pending.wanted.get(pending.final) == ANCHOR:
        captures[pending.final] = (ANCHOR, reply.prompt_head)
    appended = None
    try:
        if not adopt and cache is not None:  # only the rows its entry lacks, into that entry's buffer
            base = reply.base if reply.base is not None else appending.restored_base(pending)
            appended = appending.append_reply(layout, cache, base, caches, idx, length)
            cache.count("reply_appends" if appended is not None else "reply_row_copies")
        kv = appended.kv if appended is not None else rows.kv_rows(layout, caches, idx, length, copy=not adopt)
        head = rows.capture(layout, caches, idx, length)
        store(pending, fed, kv=kv, head=head, prompt_head=reply.prompt_head, captures=captures)
    except Exception as exc:  # fail closed: the prompt-end entry (or its deferral) stands
        fail_closed(exc, f"apc_lineage reply commit of {length} tokens", log=log)
        return False
    finally:
        if appended is not None and cache is not None:  # only appended where a cache was given
            appended.finish(cache)
    settle()
    mode = "adopt" if adopt else "append" if appended is not None else "copy"
    copied = f" appended_rows={appended.rows}" if appended is not None else ""
    elapsed = (time.perf_counter() - start) * 1000
    if reply.record is not None:
        reply.record.commit_ms += elapsed
        reply.record.reply_tokens = len(fed)
    if deferred is not None:  # the deferred entry's commit, past its reply
        log.info("apc_copyfree commit uid=%s mode=%s reason=end tokens=%d kv_bytes=%d buffer_rows=%d "
                 "deferred_s=%.2f ms=%.1f reply=%d%s", deferred.uid, mode, length,
                 kv.nbytes, capacity, time.monotonic() - deferred.since, elapsed, len(fed), copied)
    else:  # its entry was stored at the prompt end already (a join, a lookup surfaced it)
        log.info("apc_lineage reply kept uid=%s mode=%s tokens=%d kv_bytes=%d ms=%.1f reply=%d%s",
                 batch.uids[idx], mode, length, kv.nbytes, elapsed, len(fed), copied)
    return True


def best_restore(pending: Pending, prompt: np.ndarray) -> int:
    """The longest restore point a deferred entry (head at ``final``, its captures) offers."""
    common = common_prefix_len(prompt, pending.tokens[:pending.final])
    lengths = [pending.final, *pending.taken]
    return max((n for n in lengths if n <= common and n < prompt.shape[0]), default=0)


__all__ = ["Deferred", "best_restore", "commit_reply", "resolve", "surfaces"]
