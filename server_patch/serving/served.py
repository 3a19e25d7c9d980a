"""The models this server serves: a request may name one of them, never load another.

mlx-vlm 0.7.10's ``get_cached_model(request.model)`` loads whatever a request names, and first
unloads the model it holds (its prompt cache cleared, the lineage runtime rebuilt): ``"model":
"/etc"``, or the served path with a trailing slash, emptied the cache for any client. Here a
server serves what it was started with: ``--model`` (with its adapter) and the other
``--*-model`` preloads, each for its own kind, under their paths (normalised: ``~``, symlinks,
``./``, trailing slashes) and, for ``--model``, the names in ``APC_SERVED_MODEL_NAME`` (vLLM's
``--served-model-name``). Any other name, or another adapter, is a 404 ``model_not_found`` (as
vLLM and OpenAI answer it), raised before anything is unloaded. ``POST /admin/model`` (admin
token) switches the served model; ``APC_LOAD_REQUESTED_MODEL=1`` restores mlx-vlm's behaviour.

``SERVED`` is the process's, on purpose: mlx-vlm 0.7.10 serves one FastAPI app per process
(``mlx_vlm.server.app``'s module-level ``app`` and model cache), whose lifespan captures the
preload variables of the process's environment. It is not a runtime's state: what is served
outlives the lineage runtime of each model loaded (a switch replaces the runtime, and updates
this). ``PRELOADS`` is a constant table.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from server_patch import settings

TEXT = "text_generation"
# mlx-vlm 0.7.10's preload variables (server/cli.py) -> the cache group each loads into (app.py).
PRELOADS = {
    "MLX_VLM_PRELOAD_MODEL": TEXT,
    "MLX_VLM_PRELOAD_IMAGE_MODEL": "image_generation",
    "MLX_VLM_PRELOAD_TTS_MODEL": "tts",
    "MLX_VLM_PRELOAD_STT_MODEL": "stt",
    "MLX_VLM_PRELOAD_EMBEDDING_MODEL": "embedding",
    "MLX_VLM_PRELOAD_RERANKER_MODEL": "reranker",
    "MLX_VLM_PRELOAD_DECISION_MODEL": "decision",
}
ADAPTER_ENV = "MLX_VLM_PRELOAD_ADAPTER"
SWITCH_HINT = "switching models needs the admin token: POST /admin/model"
# What a client sending its own name for the model (``gpt-4o``, ``glm``) needs the server to say.
NAME_HINT = "to let clients call it by another name, start the server with --served-model-name NAME"


def normalise(name: Any) -> str | None:
    """One spelling per model: a local path resolved (``~``, symlinks, ``.``, a trailing ``/``),
    any other name (a Hugging Face repo id) without surrounding blanks or trailing slashes."""
    if name is None:
        return None
    text = str(name).strip()
    local = os.path.expanduser(text)
    if text and os.path.exists(local):
        return os.path.realpath(local)
    return text.rstrip("/") or text


@dataclass(frozen=True)
class Served:
    """One served model: what mlx-vlm loads, and every normalised name that selects it."""

    path: str
    adapter: str | None
    names: tuple[str, ...]  # what clients may send besides the path (APC_SERVED_MODEL_NAME)
    keys: frozenset[str | None]

    @classmethod
    def of(cls, path: str, adapter: str | None = None, names: Iterable[str] = ()) -> "Served":
        names = tuple(n for n in names if n.strip())
        return cls(path, adapter or None, names, frozenset({normalise(path), *(normalise(n) for n in names)}))

    def answers_to(self, requested: Any) -> bool:
        return normalise(requested) in self.keys

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.path, "adapter": self.adapter, "served_model_names": list(self.names)}


class ModelNotServed(HTTPException):
    """A request named a model (or adapter) this server does not serve: 404, nothing unloaded."""

    def __init__(self, requested: Any, served: list[str], param: str = "model") -> None:
        shown = ", ".join(repr(s) for s in served) if served else "no model of this kind"
        hints = f"{NAME_HINT}; {SWITCH_HINT}" if param == "model" else SWITCH_HINT
        super().__init__(404, detail=f"The {param} {requested!r} does not exist on this server "
                                     f"(it serves {shown}); {hints}")
        self.param = param


def error_body(exc: ModelNotServed) -> dict[str, Any]:
    """OpenAI's error shape (vLLM's too), plus FastAPI's ``detail`` that mlx-vlm clients read."""
    return {"error": {"message": exc.detail, "type": "invalid_request_error", "param": exc.param,
                      "code": "model_not_found"}, "detail": exc.detail}


async def not_served_response(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ModelNotServed)
    return JSONResponse(error_body(exc), status_code=exc.status_code)


class ServedModels:
    """The served model of each cache group; read on every model lookup, changed by the admin."""

    def __init__(self) -> None:
        self._by_group: dict[str, Served] = {}
        self._lock = threading.Lock()
        self.load_requested = False

    def capture(self, environ: Mapping[str, str] = os.environ) -> None:
        """What the server was started with: called as mlx-vlm's lifespan starts, before it pops
        its preload variables. A bad setting stops the server here."""
        try:
            self.load_requested = bool(settings.value("APC_LOAD_REQUESTED_MODEL", environ))
            names = settings.value("APC_SERVED_MODEL_NAME", environ)
        except ValueError as exc:
            raise SystemExit(f"server_patch: {exc}") from None
        for variable, group in PRELOADS.items():
            path = environ.get(variable)
            if path:
                text = group == TEXT
                self.serve(group, path, environ.get(ADAPTER_ENV) if text else None, names if text else ())

    def serve(self, group: str, path: str, adapter: str | None = None, names: Iterable[str] = ()) -> Served | None:
        """Serve ``path`` for ``group`` from now on; returns what was served before."""
        with self._lock:
            before = self._by_group.get(group)
            self._by_group[group] = Served.of(path, adapter, names)
            return before

    def restore(self, group: str, before: Served | None) -> None:
        """Undo ``serve`` (a switch whose load failed)."""
        with self._lock:
            if before is None:
                self._by_group.pop(group, None)
            else:
                self._by_group[group] = before

    def get(self, group: str = TEXT) -> Served | None:
        with self._lock:
            return self._by_group.get(group)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {group: served.as_dict() for group, served in sorted(self._by_group.items())}

    def resolve(self, group: str, requested: Any, adapter: Any, *, inherit: Any) -> tuple[Any, Any]:
        """The (path, adapter) mlx-vlm should load for a request naming ``requested``: the served
        one's own spelling (so the cache key matches and nothing reloads), or ModelNotServed."""
        if self.load_requested:
            return requested, adapter
        served = self.get(group)
        if served is None or not served.answers_to(requested):
            raise ModelNotServed(requested, [served.path, *served.names] if served else [])
        if adapter is not inherit and normalise(adapter) != normalise(served.adapter):
            raise ModelNotServed(adapter, [served.adapter or "no adapter"], "adapter_path")
        return served.path, served.adapter


SERVED = ServedModels()
capture = SERVED.capture
resolve = SERVED.resolve


def realtime_model(requested: Any) -> Any:
    """What the realtime websocket may load for ``requested``: the served text model's path (the
    one model a client may name), or ModelNotServed; ``APC_LOAD_REQUESTED_MODEL=1`` lets any through."""
    return SERVED.resolve(TEXT, requested, None, inherit=None)[0]
