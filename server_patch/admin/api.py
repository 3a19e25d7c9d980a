"""``/admin``: what the lineage cache holds, and the verbs an operator needs.

Every route needs ``Authorization: Bearer <token>``. Bad input is a 4xx with a JSON message;
the handlers never let an exception become a 500 with a traceback. ``guard.py`` stands in front:
no CORS here or on mlx-vlm's management routes (which it also puts behind the token), body
and event-stream caps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Optional

import psutil
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from server_patch import MLX_VLM_VERSION, PATCH_VERSION, clock, settings
from server_patch.admin import schema, views
from server_patch.infra.attributes import put_state, state_of
from server_patch.infra.auth import TokenError, load_or_create_token, token_matches
from server_patch.admin.flush import flush_report
from server_patch.infra.guard import STREAMS, AdminLimits, install_outermost
from server_patch.infra.internal import internal_chat
from server_patch.admin.metrics import exposition
from server_patch.infra.traffic import TrafficMiddleware
from server_patch.admin.model_switch import model_router
from server_patch.canary.admin import verify_router
from server_patch.infra.deps import PartsDep, lineage_of as _lineage
from server_patch.lineage.summary import hit_summary
from server_patch.boundaries.anchors import anchor_label
from server_patch.lineage import CacheError, LineageConfig
from server_patch.lineage.model import Reason

if TYPE_CHECKING:
    from server_patch.integration.parts import Parts
    from server_patch.integration.runtime import LineageRuntime

log = logging.getLogger("server_patch.admin")

PREFIX = "/admin"
# With the PID, names this process exactly: apcctl never signals a later owner of a reused PID.
_CREATE_TIME = psutil.Process().create_time()


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DrainBody(Strict):
    retry_after: int = Field(5, ge=1, le=3600, description="Seconds clients should wait (Retry-After).")


class NewAnchorBody(Strict):
    system: str = Field(..., min_length=1, description="The system prompt text.")
    tools: Optional[list[dict[str, Any]]] = Field(None, description="OpenAI-style tool list.")
    tenant: Optional[str] = Field(None, description="X-APC-Tenant the sessions will send, if any.")


class FlushBody(Strict):
    timeout: float = Field(60.0, gt=0, le=3600)


def _server_app_module() -> Any:
    return sys.modules.get("mlx_vlm.server.app")


def _mlx_runtime() -> Any:
    module = _server_app_module()
    return getattr(module, "runtime", None) if module is not None else None


def _require_token(request: Request) -> None:
    expected = state_of(request.app, "apc_admin_token")
    if not token_matches(expected, request.headers.get("authorization")):
        raise HTTPException(401, detail="missing or wrong admin token (Authorization: Bearer <token>)",
                            headers={"WWW-Authenticate": "Bearer"})


router = APIRouter(prefix=PREFIX, tags=["admin"], dependencies=[Depends(_require_token)])


def _model_path() -> str | None:
    runtime = _mlx_runtime()
    if runtime is None:
        return None
    try:
        return runtime.model_cache.get("model_path")
    except Exception:
        return None


def _pool() -> dict[str, int]:
    import mlx.core as mx

    return {"active_bytes": int(mx.get_active_memory()), "cache_bytes": int(mx.get_cache_memory()),
            "peak_bytes": int(mx.get_peak_memory())}


def _queued() -> int:
    runtime = _mlx_runtime()
    try:
        return int(runtime.response_generator.requests.qsize())
    except Exception:
        return 0


@router.get("/status", summary="Server identity, budgets, idle state and counters")
def status(parts: PartsDep) -> dict[str, Any]:
    current = parts.runtimes.current
    started = getattr(router, "started", clock.wall())
    lineage = None
    if current is not None:
        cfg = current.config
        lineage = schema.LineageInfo(
            budgets=schema.Budgets.from_json(current.cache.budgets(), "budgets"),
            stats=dict(current.cache.stats),
            layout=current.layout.describe(),
            disk_path=str(current.disk.root) if current.disk else None,
            disk_pending_writes=current.disk.pending if current.disk else 0,
            disk=current.disk.health() if current.disk else None,
            config={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()})
    return schema.Status(
        server=schema.ServerInfo(
            model=_model_path(), pid=os.getpid(), create_time=_CREATE_TIME,
            uptime_s=clock.monotonic() - getattr(router, "started_monotonic", clock.monotonic()),
            started=started, mlx_vlm_version=MLX_VLM_VERSION, patch_version=PATCH_VERSION,
            fingerprint=current.fingerprint if current else None),
        idle=schema.Idle.from_json({**parts.traffic.snapshot(), "queued": _queued()}, "idle"),
        pool=schema.Pool.from_json(_pool(), "pool"),
        admin=schema.AdminInfo.from_json({"event_streams": STREAMS.open, **asdict(router.limits)}, "admin"),
        canary=schema.CanaryBrief(suspects=sorted(parts.canary.book.suspects), on_fail=parts.canary.book.on_fail),
        # Always, so no reader rebuilds the empty summary: zeros before the cache starts.
        hits=schema.Hits.from_json(hit_summary(current.cache.stats if current is not None else {}), "hits"),
        lineage=lineage,
        sizing=_sizing(current, lineage.budgets if lineage else None),
        oracle=current.cache.misses.totals() if current is not None else None,
        invalid_settings=settings.problems(os.environ),
    ).to_json()


def _sizing(current: LineageRuntime | None, budgets: schema.Budgets | None = None) -> schema.Sizing:
    """Budgets, memory and the disk volume, from the first second: the running cache's budgets,
    or before the first request the configured ones (the cache does not exist yet)."""
    if current is not None:
        return views.sizing_view(current.config, budgets=budgets or current.cache.budgets())
    try:
        config = LineageConfig.from_env()
    except ValueError:  # the launcher refused it already; never a 500 here
        config = LineageConfig()
    return views.sizing_view(config)


@router.get("/entries", summary="Lineage entries and anchors with their checkpoints")
def entries(tier: str = Query("all", pattern="^(ram|disk|all)$"),
            kind: str = Query("all", pattern="^(conversation|anchor|all)$"), *, parts: PartsDep) -> dict[str, Any]:
    current = parts.runtimes.current
    if current is None:  # before the first request: nothing held yet, but the budgets are known
        return schema.Entries(entries=[], budgets=_sizing(None).budgets, started=False).to_json()
    records = {r.id: r for r in current.cache.records()}
    rows = []
    if tier in ("ram", "all"):
        rows += [views.entry_view(e, records.get(e.id)) for e in current.cache.entries()]
    if tier in ("disk", "all"):
        in_ram = {e.id for e in current.cache.entries()}
        rows += [views.record_view(r) for r in records.values() if r.id not in in_ram]
    if kind != "all":
        rows = [r for r in rows if r.kind == kind]
    return schema.Entries(entries=rows, budgets=schema.Budgets.from_json(current.cache.budgets(), "budgets"),
                          started=True).to_json()


@router.get("/entries/{entry_id}", summary="One entry")
def entry(entry_id: str, parts: PartsDep) -> dict[str, Any]:
    current = _lineage(parts)
    records = {r.id: r for r in current.cache.records()}
    found = current.cache.get(entry_id)
    if found is not None:
        return views.entry_view(found, records.get(entry_id)).to_json()
    if entry_id in records:
        return views.record_view(records[entry_id]).to_json()
    raise HTTPException(404, detail=schema.not_held(entry_id, current.cache.absorbed_into(entry_id)))


@router.delete("/entries/{entry_id}", summary="Evict an entry or anchor from RAM and disk")
def evict(entry_id: str, parts: PartsDep, reason: str = Query(
        Reason.OPERATOR.value, description="Why, for the events and the journal: 'operator', or 'restart probe' "
                                     "(the anchor apcctl restart pinned to probe the restart)")) -> dict[str, Any]:
    if reason not in (Reason.OPERATOR, Reason.RESTART_PROBE):
        raise HTTPException(422, detail=f"reason must be {Reason.OPERATOR!r} or {Reason.RESTART_PROBE!r}")
    try:
        freed = _lineage(parts).cache.evict(entry_id, reason)
    except CacheError:
        raise HTTPException(404, detail=f"no entry {entry_id!r}") from None
    return schema.Evicted(evicted=entry_id, freed_bytes=freed).to_json()


@router.get("/anchors", summary="Anchors (system prompt + tools prefixes)")
def anchors(parts: PartsDep) -> dict[str, Any]:
    return {"anchors": entries(tier="all", kind="anchor", parts=parts)["entries"]}


def _in_ram(verb: Any, entry_id: str) -> dict[str, Any]:
    """Apply a cache verb that needs the entry in RAM; an unknown id is a 404."""
    try:
        return views.entry_view(verb(entry_id)).to_json()
    except CacheError:
        raise HTTPException(404, detail=f"no entry {entry_id!r} in RAM") from None


@router.post("/anchors/{entry_id}/pin", summary="Pin an entry as an anchor")
def pin(entry_id: str, parts: PartsDep) -> dict[str, Any]:
    return _in_ram(_lineage(parts).cache.pin, entry_id)


@router.post("/anchors/{entry_id}/unpin", summary="Unpin an anchor (it joins the conversation LRU)")
def unpin(entry_id: str, parts: PartsDep) -> dict[str, Any]:
    return _in_ram(_lineage(parts).cache.unpin, entry_id)


@router.post("/anchors", summary="Prefill a system prompt + tools now and pin it")
async def new_anchor(body: NewAnchorBody, request: Request, parts: PartsDep) -> dict[str, Any]:
    model = _model_path()
    if model is None:
        raise HTTPException(409, detail="no model is loaded")
    messages = [{"role": "system", "content": body.system}, {"role": "user", "content": "."}]
    payload = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
    if body.tools:
        payload["tools"] = body.tools
    headers = {"x-apc-tenant": body.tenant} if body.tenant else {}
    before = {e.id for e in _lineage(parts).cache.entries()} if parts.runtimes.current else set()
    status_code, answer = await internal_chat(state_of(request.app, "apc_inner_app"), payload, headers)
    if status_code != 200:
        raise HTTPException(422, detail=f"prefill failed: {answer}")
    anchors_now = [e for e in _lineage(parts).cache.entries() if e.is_anchor]
    created = [e for e in anchors_now if e.id not in before]
    label = anchor_label([{"role": "system", "content": body.system}], body.tools)
    same = [e for e in anchors_now if e.label == label]  # an anchor this prompt already had
    chosen = created[0] if created else max(same, key=lambda e: e.last_used, default=None)
    if chosen is None:
        raise HTTPException(422, detail=(
            "no anchor was captured: a conversation entry already covers this system prompt, or "
            "the chat template renders no separate system/tools prefix"))
    if not chosen.pinned:  # an anchor an operator unpinned: pinned again by the policy's own verb
        chosen = _lineage(parts).cache.pin(chosen.id)
    return schema.NewAnchor(anchor=views.entry_view(chosen), created=bool(created)).to_json()


@router.get("/requests", summary="Per-request timing records (poll with since=)")
def requests_(parts: PartsDep, since: int = Query(0, ge=0),
              limit: int = Query(200, ge=1, le=5000)) -> dict[str, Any]:
    current = parts.runtimes.current
    records = current.timings.since(since) if current else []
    return {"requests": records[-limit:]}


@router.get("/events", summary="Server-sent events: requests and cache events")
async def events(request: Request, parts: PartsDep, since: int = Query(0, ge=0)) -> StreamingResponse:
    async def stream():
        cache_seq, request_seq, ended_seq = since, 0, 0
        yield ": apc admin event stream\n\n"
        while not parts.traffic.shutting_down.is_set() and not await request.is_disconnected():
            current = parts.runtimes.current
            if current is not None:
                for seq, at, event in list(current.events):
                    if seq > cache_seq:
                        cache_seq = seq
                        yield f"event: cache\ndata: {json.dumps(views.event_view(seq, at, event))}\n\n"
                for record in current.timings.since(request_seq):
                    request_seq = max(request_seq, record["seq"])
                    yield f"event: request\ndata: {json.dumps(record)}\n\n"
                for ended_seq, record in current.timings.ended_since(ended_seq):  # its waits final
                    yield f"event: request_ended\ndata: {json.dumps(record)}\n\n"
            yield ": keepalive\n\n"
            await asyncio.sleep(0.25)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.get("/metrics", summary="Prometheus text exposition of the lineage cache")
def metrics(parts: PartsDep) -> Response:
    return Response(exposition(parts),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/flush", summary="Write every RAM entry the disk lacks, wait, and say what reached the disk")
def flush(parts: PartsDep, body: Optional[FlushBody] = None) -> dict[str, Any]:
    return flush_report(_lineage(parts), body.timeout if body else 60.0).to_json()


@router.post("/drain", summary="Refuse new inference requests (503 + Retry-After); finish those in flight")
def drain(parts: PartsDep, body: Optional[DrainBody] = None) -> dict[str, Any]:
    parts.traffic.retry_after = body.retry_after if body else 5
    parts.traffic.draining = True
    return parts.traffic.snapshot()


@router.post("/undrain", summary="Admit new requests again")
def undrain(parts: PartsDep) -> dict[str, Any]:
    parts.traffic.draining = False
    return parts.traffic.snapshot()


router.include_router(verify_router)  # /admin/verify: the canary (server_patch.canary.admin)
router.include_router(model_router)  # /admin/model: the served model and its switch (admin.model_switch)


@router.get("/openapi.json", summary="The OpenAPI schema of /admin")
def openapi(request: Request) -> dict[str, Any]:
    spec = request.app.openapi()  # (not ``schema``: that is the answers' types, admin.schema)
    paths = {p: v for p, v in spec.get("paths", {}).items() if p.startswith(PREFIX)}
    return {**spec, "paths": paths, "info": {**spec.get("info", {}), "title": "apcctl admin API",
                                             "version": PATCH_VERSION}}


def install(app: FastAPI, parts: Parts) -> None:
    """Mount /admin, the traffic middleware, the guard and the token on mlx-vlm's app; the
    routes reach ``parts`` (the server's, ``integration.parts``) through ``infra.deps``.

    Runs while mlx-vlm's app module is imported, before uvicorn serves anything: a blank or
    unusable token, or a bad limit, stops the server here with a message.
    """
    try:
        token = load_or_create_token()
        limits = AdminLimits.from_env()
    except (TokenError, ValueError, OSError) as exc:
        raise SystemExit(f"server_patch: cannot start the admin endpoint: {exc}") from None
    router.started, router.started_monotonic = clock.wall(), clock.monotonic()
    router.limits = limits
    # pinning prefills go through the real route (``apc_inner_app``), counted like any request
    put_state(app, apc_admin_token=token, apc_parts=parts, apc_inner_app=app)
    app.include_router(router)
    app.add_middleware(TrafficMiddleware, traffic=parts.traffic)
    install_outermost(app, token=token, limits=limits)
