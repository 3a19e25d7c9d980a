"""Every attribute the patch sets on an mlx-vlm object, listed and explained in one place.

The patch keeps its own state on its own objects (``integration.parts.Parts``, a runtime's
``Workers``) and hands them on; it tags mlx-vlm's objects only where mlx-vlm hands nothing
else from the place that knows a value to the place that needs it. Each such attribute is an
``Attribute`` below: on what, set where, read where, and why. The overlay's edits (fields and
constructor arguments they add, ``x.name = ...`` they write), every ``app.state`` value and the
methods the copy counter wraps go through this list: ``tests/test_overlay.py`` fails on an edit
that sets an attribute not named here, on an ``app.state`` write outside ``put_state``, on a
module that assigns to what it imported from mlx-vlm beyond ``COUNTER_WRAPS``, and on a
registered name nobody sets.

``app.state`` (Starlette's per-app namespace on mlx-vlm's FastAPI app) is written only by
``put_state`` and read by ``state_of``, so a typo is an error at start, not a silent ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Attribute:
    owner: str  # the mlx-vlm object that carries it
    name: str
    set_by: str  # the overlay edit, or the module, that sets it
    read_by: str
    why: str
    edit: bool = True  # set by an overlay edit's text (else by a module's code, named in ``set_by``)


APP = "mlx-vlm's FastAPI app (``mlx_vlm.server.app.app``), ``app.state``"

ATTRIBUTES = (
    Attribute("the language model ``mlx_vlm.utils.load_model`` returns (``model.language_model``)",
              "_apc_model_path", "edit ``weights_path.language_model``",
              "``integration.coordinator`` (the runtime's ``model_dir``)",
              "mlx-vlm records where it loaded a model on the top-level model only, and the batch "
              "generator holds the language model; the disk tier is keyed by the weight files' bytes"),
    Attribute("``mlx_vlm.apc.APCManager``", "lineage_runtime", "edit ``lineage.manager_runtime`` (set to None "
              "in ``__init__``; ``integration.runtime.runtime_for`` fills it)",
              "``integration.runtime``, the door (``manager.clear()`` clears it)",
              "one lineage runtime per loaded model: the manager is what mlx-vlm builds per model and "
              "drops at unload, so the runtime lives and dies with it"),
    Attribute("``mlx_vlm.server.runtime.ServerRuntime`` (a dataclass field)", "apc_parts",
              "edit ``lineage.parts`` (``field(default_factory=...)``)",
              "the door's server-side call sites (``runtime.apc_parts``), ``integration.parts.of_server``",
              "the composition root is built once with mlx-vlm's own per-process server state and "
              "lives exactly as long"),
    Attribute("``GenerationBatch`` and ``SpeculativeGenerationBatch`` (``mlx_vlm.generate.ar``)",
              "apc_coordinator", "edits ``copyfree.batch_coordinator_argument``, "
              "``copyfree.empty_batch_coordinator``, ``speculative.batch_coordinator_argument`` "
              "(a constructor argument)",
              "the door from ``filter`` and ``next`` (rows leaving, ids fed)",
              "a decoding batch must tell the coordinator of the generator it decodes for which rows "
              "leave and what each step fed; mlx-vlm gives the batch no reference to it"),
    Attribute(APP, "apc_admin_token", "``admin.api.install``",
              "``admin.api`` (the token check), ``tenancy.middleware`` (the token stands in for an API key)",
              "the token is loaded or created once per server, at install; the middleware sees the app "
              "in the ASGI scope, not the admin router", edit=False),
    Attribute(APP, "apc_parts", "``admin.api.install``", "``infra.deps.parts_of`` (every admin route)",
              "FastAPI dependencies reach per-app objects through the request's app", edit=False),
    Attribute(APP, "apc_inner_app", "``admin.api.install``", "``admin.api`` (pinning an anchor)",
              "an anchor's prefill goes through the real chat route in-process, counted like any request",
              edit=False),
    Attribute(APP, "apc_api_keys_on", "``tenancy.middleware.install``", "``intake.metrics_view``",
              "with inference API keys on, ``/metrics``' totals are the admin token's to see", edit=False),
    Attribute("classes of ``mlx_vlm.models.cache`` and ``mlx_vlm.apc`` (measurement only)",
              "the methods in ``COUNTER_WRAPS``", "``copyfree.counter.install``, only with ``--copy-counter`` "
              "(``APC_COPY_COUNTER=1``), which the launcher installs", "mlx-vlm itself (it calls them)",
              "the copy counter counts every copy of cache rows, stock's included, so it has to sit in "
              "mlx-vlm's own methods; a measurement mode, never a serving one "
              "(``tests/copyfree/test_copy_ledger.py``: serving modules never load it)", edit=False),
)

# What the copy counter replaces with a counting wrapper (``copyfree.counter.install``).
COUNTER_WRAPS = frozenset({
    "BatchKVCache.merge", "BatchKVCache.extract", "BatchKVCache.extend", "BatchKVCache.filter",
    "BatchKVCache.update_and_fetch", "KVCache.extract", "KVCache.prefix_cache_reserve",
    "KVCache.update_and_fetch", "PoolingCache.update_and_fetch", "PoolingCache.accumulate_windows",
    "BatchPoolingCache.update_and_fetch", "BatchPoolingCache.merge", "BatchPoolingCache.extract",
    "ArraysCache.merge", "apc._clone_prompt_cache_for_apc",
})

NAMES = frozenset(a.name for a in ATTRIBUTES if a.edit)  # what the overlay's edits may set
APP_STATE = frozenset(a.name for a in ATTRIBUTES if a.owner == APP)


def put_state(app: Any, **values: Any) -> None:
    """Set registered ``app.state`` values on ``app``; an unregistered name is a ``KeyError``."""
    unknown = sorted(set(values) - APP_STATE)
    if unknown:
        raise KeyError(f"not registered in server_patch.infra.attributes: {', '.join(unknown)}")
    for name, value in values.items():
        setattr(app.state, name, value)


def state_of(app: Any, name: str, default: Any = None) -> Any:
    """A registered ``app.state`` value of ``app`` (``default`` where it is not set, or ``app`` has no state)."""
    if name not in APP_STATE:
        raise KeyError(f"not registered in server_patch.infra.attributes: {name}")
    return getattr(getattr(app, "state", None), name, default)
