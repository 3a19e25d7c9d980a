"""``/admin/verify``: run the canary now on chosen restore points, read its state, clear suspects.

Mounted inside the admin router (``server_patch.admin.api``), so the bearer token and the
guard apply. The check itself runs on the generation thread when it is idle (``runner``); the
handler (a worker thread) waits for it up to ``timeout_s`` and reports what finished.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from server_patch.infra.deps import PartsDep
from server_patch.canary import points as P
from server_patch.canary.check import FAIL, PASS, SKIP
from server_patch.lineage import LOG_KINDS, CacheError

verify_router = APIRouter()


class VerifyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    entry: Optional[str] = Field(None, min_length=1, max_length=64,
                                 description="Check every restore point of this entry (RAM and its disk file).")
    recent: Optional[int] = Field(None, ge=1, le=1000,
                                  description="Check every restore point of the N most recently used entries.")
    timeout_s: float = Field(600.0, gt=0, le=3600, description="How long to wait for an idle server.")


class ClearBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Optional[str] = Field(None, description="Clear only this restore kind (default: all).")


def _runtime(parts: Any) -> Any:
    current = parts.runtimes.current
    if current is None:
        raise HTTPException(409, detail="no model has been served yet: nothing to verify")
    return current


def _choose(cache: Any, body: VerifyBody) -> list[P.Point]:
    if body.entry is not None and body.recent is not None:
        raise HTTPException(422, detail="give entry or recent, not both")
    if body.entry is not None:
        try:
            return P.of_entry(cache, body.entry)
        except CacheError:
            raise HTTPException(404, detail=f"no entry {body.entry!r}") from None
    if body.recent is not None:
        return P.recent(cache, body.recent)
    return P.every_kind(cache)


@verify_router.post("/verify", summary="Check restore points against a cold prefill (runs while idle)")
def verify(parts: PartsDep, body: Optional[VerifyBody] = None) -> dict[str, Any]:
    body = body or VerifyBody()
    current = _runtime(parts)
    chosen = _choose(current.cache, body)
    book = parts.canary.book
    job = parts.canary.runner.submit(chosen, source="admin")
    complete = _wait(job, body.timeout_s, parts.traffic)
    if not complete:
        job.cancelled = True
    order = {(p.entry_id, p.tier, p.length): i for i, p in enumerate(chosen)}
    results = sorted((r.as_dict() for r in list(job.results)),
                     key=lambda r: order.get((r["entry_id"], r["tier"], r["length"]), len(order)))
    counts = {name: sum(1 for r in results if r["result"] == name) for name in (PASS, FAIL, SKIP)}
    return {"complete": complete, "points": len(chosen), "results": results, **counts,
            "errors": sum(1 for r in results if r["result"] not in (PASS, FAIL, SKIP)),
            "abandoned": job.abandons, "suspects": sorted(book.suspects), "on_fail": book.on_fail}


def _wait(job: Any, timeout_s: float, traffic: Any) -> bool:
    """Until the job is done, the timeout passes, or the server begins to shut down (a waiting
    handler would hold uvicorn's shutdown, and so the flush of unwritten entries, until then)."""
    deadline = time.monotonic() + timeout_s
    while not job.done.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline or traffic.shutting_down.is_set():
            return False
    return True


@verify_router.get("/verify", summary="The canary's counters, last result, suspect kinds and schedule")
def verify_state(parts: PartsDep) -> dict[str, Any]:
    book, runner, runtime = parts.canary.book, parts.canary.runner, parts.runtimes.current
    loading = runtime.checks.pending() if runtime is not None else 0  # the served model's checks' files
    return {**book.summary(), "queued": runner.queued(), "running": runner.running, "loading": loading,
            "interval_s": runner.schedule.interval_s, "idle_s": runner.schedule.idle_s,
            "chunk": runner.settings.chunk, "max_tokens": runner.settings.max_tokens,
            "recent": list(book.history)[-20:]}


@verify_router.post("/verify/clear", summary="Clear suspect restore kinds: requests restore them again")
def verify_clear(parts: PartsDep, body: Optional[ClearBody] = None) -> dict[str, Any]:
    kind = body.kind if body else None
    if kind is not None and kind not in LOG_KINDS:
        raise HTTPException(422, detail=f"unknown restore kind {kind!r}")
    book = parts.canary.book
    return {"cleared": book.clear(kind), "suspects": sorted(book.suspects)}
