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


def cancelled(uid: Any, info: dict) -> None:
    """A request was cancelled and the generator let it go: its record says so."""
    current = _runtime.current()
    if current is None:
        return
    try:
        current.timings.cancelled(uid, info.get("request_id", uid))
    except Exception as exc:
        log.debug("apc_lineage cancel hook failed: %s", exc)


def shutdown() -> None:
    """Write unwritten entries before the process exits, so a restart starts warm."""
    try:
        _runtime.flush_all()
    except Exception as exc:
        log.warning("apc_lineage shutdown flush failed: %s", exc)
