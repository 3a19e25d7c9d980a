"""The few functions patched mlx-vlm code calls; each is cheap and never raises."""

from __future__ import annotations

import logging
from typing import Any

from server_patch.integration import runtime as _runtime

log = logging.getLogger("server_patch.lineage")


def prefill_completed(uid: Any, info: dict, prompt_time_s: float) -> None:
    current = _runtime.current()
    if current is None:
        return
    try:
        current.timings.prefill_completed(uid, info.get("request_id", uid), prompt_time_s)
    except Exception as exc:
        log.debug("apc_lineage prefill hook failed: %s", exc)


def first_token(uid: Any, request_id: Any, ttft_s: float) -> None:
    current = _runtime.current()
    if current is None:
        return
    try:
        current.timings.first_token(uid, request_id, ttft_s)
    except Exception as exc:
        log.debug("apc_lineage first-token hook failed: %s", exc)


def queued_tokens(batch_gen: Any, uid: Any) -> int | None:
    """The prompt length of ``uid`` while it still waits in the generator's queue (its prefill,
    and so its lookup, not started), else None: read before a cancel removes it."""
    try:
        for sequence in getattr(batch_gen, "unprocessed_prompts", ()) or ():
            if sequence[0] == uid:
                return len(sequence[1])
    except Exception as exc:
        log.debug("apc_lineage queued-prompt probe failed: %s", exc)
    return None


def cancelled(uid: Any, info: dict, queued_tokens: int | None = None) -> None:
    """A request was cancelled and the generator let it go: its record says so (one cancelled
    while queued never reached the cache, so its record is made here and counted)."""
    current = _runtime.current()
    if current is None:
        return
    try:
        request_id = info.get("request_id", uid)
        if queued_tokens is not None:
            current.timings.cancelled_queued(request_id, queued_tokens)
            current.cache.note_cancelled_queued()
        else:
            current.timings.cancelled(uid, request_id)
    except Exception as exc:
        log.debug("apc_lineage cancel hook failed: %s", exc)


def shutdown() -> None:
    """Write unwritten entries before the process exits, so a restart starts warm."""
    try:
        _runtime.flush_all()
    except Exception as exc:
        log.warning("apc_lineage shutdown flush failed: %s", exc)
