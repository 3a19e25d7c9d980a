"""A server serves the model it was started with, to the origins and hosts it was told.

* ``get_cached_model`` asks ``server_patch.serving.served`` which model a request's name means:
  the served one's own path (so a trailing slash reloads nothing), or a 404 ``model_not_found``
  before mlx-vlm unloads anything. The served models are captured as the lifespan starts,
  before mlx-vlm pops its preload variables.
* The realtime websocket's ``session.update`` (``session.model`` or ``?model=``) goes through
  the same check (the served text model, or an ``error`` event ``model_not_found``) before its
  worker loads anything: stock loads any local directory or starts a Hub download.
* ``_unload_model_cache_group`` closes the lineage runtime of the APC manager it unloads before
  stock clears it: its unwritten entries reach the disk, its threads and journal end.
* The origin guard (``server_patch.serving.origins``) goes outside mlx-vlm's CORS middleware,
  and the 404 gets OpenAI's error shape (Anthropic's on ``/v1/messages``, whose handler would
  turn it into a 500).

This module must not import mlx-vlm (topics load before the import hook).
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.server.app",
        Edit(
            name="served_model.capture",
            old=('@asynccontextmanager\nasync def lifespan(app):\n'
                 '    model_path = os.environ.pop("MLX_VLM_PRELOAD_MODEL", None)\n'),
            new=("from server_patch.serving import served as _apc_served\n"
                 "\n\n"
                 '@asynccontextmanager\nasync def lifespan(app):\n'
                 "    _apc_served.capture(os.environ)\n"
                 '    model_path = os.environ.pop("MLX_VLM_PRELOAD_MODEL", None)\n'),
        ),
        Edit(
            name="served_model.install",
            old="inference_router = APIRouter(\n    dependencies=[Depends(_require_management_api_key)],\n)\n",
            new=("inference_router = APIRouter(\n    dependencies=[Depends(_require_management_api_key)],\n)\n"
                 "from server_patch.serving.app import install as _apc_served_install\n"
                 "\n"
                 "_apc_served_install(app)\n"),
        ),
        Edit(
            name="served_model.retire_runtime",
            old=('    apc_manager = cache.get("apc_manager")\n    if apc_manager is not None:\n'
                 "        # APC entries own model-specific KV state."),
            new=('    apc_manager = cache.get("apc_manager")\n'
                 "    from server_patch.integration import hooks as _apc_door\n"
                 "\n"
                 "    _apc_door.model_unloading(runtime.apc_parts, apc_manager)\n"
                 "    if apc_manager is not None:\n"
                 "        # APC entries own model-specific KV state."),
        ),
        Edit(
            name="served_model.resolve",
            old="    registry = _model_cache_registry()\n    if adapter_path is _INHERIT_ADAPTER:\n",
            new=("    model_path, adapter_path = _apc_served.resolve(\n"
                 "        cache_group, model_path, adapter_path, inherit=_INHERIT_ADAPTER\n"
                 "    )\n"
                 "    registry = _model_cache_registry()\n    if adapter_path is _INHERIT_ADAPTER:\n"),
        ),
    ),
    patch_of(
        "mlx_vlm.server.anthropic",
        Edit(
            name="served_model.anthropic_import",
            old="get_cached_model = None\n",
            new="get_cached_model = None\nfrom server_patch.serving.served import ModelNotServed as _apc_ModelNotServed\n",
        ),
        Edit(  # /v1/messages answers every exception with a 500: the 404 stays a 404, Anthropic-shaped
            name="served_model.anthropic_not_found",
            old=("    except Exception as e:\n        traceback.print_exc()\n        mx.clear_cache()\n"
                 "        gc.collect()\n        return _anthropic_error_response(500, str(e), \"api_error\")\n"),
            new=("    except _apc_ModelNotServed as e:\n"
                 "        return _anthropic_error_response(404, e.detail, \"not_found_error\")\n"
                 "    except Exception as e:\n        traceback.print_exc()\n        mx.clear_cache()\n"
                 "        gc.collect()\n        return _anthropic_error_response(500, str(e), \"api_error\")\n"),
        ),
    ),
    patch_of(
        "mlx_vlm.server.realtime",
        Edit(
            name="served_model.realtime_import",
            old="from .runtime import runtime\n",
            new="from .runtime import runtime\nfrom server_patch.serving import served as _apc_served\n",
        ),
        Edit(  # session.update (or ?model=) named any directory or Hub repo, and the worker loaded it
            name="served_model.realtime",
            old=('                    await send_error("session.update.session.model is required")\n'
                 "                    continue\n"),
            new=('                    await send_error("session.update.session.model is required")\n'
                 "                    continue\n"
                 "                try:\n"
                 "                    model_name = _apc_served.realtime_model(model_name)\n"
                 "                except _apc_served.ModelNotServed as e:\n"
                 '                    await send_error(e.detail, code="model_not_found")\n'
                 "                    continue\n"),
        ),
    ),
)
