"""``/admin/model``: the model this server serves, and the one way to switch it (admin token).

A request naming another model gets 404 ``model_not_found`` (``server_patch.serving.served``);
an operator switches here instead. The switch loads the new model as mlx-vlm's request path
would (``get_cached_model``): the old model is unloaded first, requests in flight on it end,
and its lineage runtime is closed (unwritten entries written for at most
``APC_LINEAGE_SHUTDOWN_FLUSH_S``, then its journal ends and its workers close, their threads
going back to the process's park for the next runtime: ``infra.workers``). A load that fails serves
the old model again. Mounted inside the admin router, so the token and the guard apply.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any, Optional

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from server_patch.infra.deps import PartsDep
from server_patch.infra.workers import PARK
from server_patch.serving.served import SERVED, TEXT

model_router = APIRouter()
THREAD_PREFIX = "apc-lineage-"  # the runtime's ticker and disk writer


class SwitchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(..., min_length=1, max_length=4096, description="Model directory or Hugging Face repo.")
    adapter_path: Optional[str] = Field(None, min_length=1, max_length=4096, description="LoRA adapter, if any.")
    served_model_name: list[str] = Field(default_factory=list, max_length=16,
                                         description="Names clients may send for it besides its path.")


def _app_module() -> Any:
    module = sys.modules.get("mlx_vlm.server.app")
    if module is None:
        raise HTTPException(409, detail="mlx-vlm's server is not loaded in this process")
    return module


def model_view(parts: Any) -> dict[str, Any]:
    """What is served and loaded, the lineage runtimes and their worker threads open (one of each
    kind after any number of switches), and the threads the workers borrow (``infra.workers``:
    a replaced runtime's threads serve the next one, so their number stays flat)."""
    module = sys.modules.get("mlx_vlm.server.app")
    try:
        loaded = module.runtime.model_cache.get("model_path") if module is not None else None
    except Exception:
        loaded = None
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX))
    current = parts.runtimes.current
    return {"served": SERVED.as_dict(), "loaded_model": loaded,
            "lineage": {"open_runtimes": parts.runtimes.count(), "threads": threads,
                        "runtime_started": current.started if current is not None else None,
                        "worker_threads": PARK.counts()}}


def _load(module: Any, body: SwitchBody, parts: Any) -> None:
    """Serve and load ``body``'s model; on failure serve (and reload) the previous one. One
    switch at a time per server (``parts.switching``)."""
    with parts.switching:
        before = SERVED.serve(TEXT, body.model, body.adapter_path, body.served_model_name)
        try:
            module.get_cached_model(body.model, body.adapter_path, model_kind=TEXT)
        except Exception as exc:
            SERVED.restore(TEXT, before)
            detail = getattr(exc, "detail", None) or str(exc)
            if before is not None:
                try:
                    module.get_cached_model(before.path, before.adapter, model_kind=TEXT)
                except Exception:
                    pass  # the next request that names it tries again
            raise HTTPException(422, detail=f"cannot load {body.model!r}: {detail}; "
                                            f"still serving {before.path if before else 'nothing'!r}") from None


@model_router.get("/model", summary="The served model (and its names), the loaded one, open lineage runtimes")
def served_model(parts: PartsDep) -> dict[str, Any]:
    return model_view(parts)


@model_router.post("/model", summary="Switch the served model: unload the old one (its cache written), load this")
async def switch_model(body: SwitchBody, parts: PartsDep) -> dict[str, Any]:
    module = _app_module()
    await asyncio.to_thread(_load, module, body, parts)
    return model_view(parts)
