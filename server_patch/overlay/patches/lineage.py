"""The lineage cache's hooks into mlx-vlm 0.7.10: each edit calls the one door,
``server_patch.integration.hooks`` (imported as ``_apc_door``), and hands it what it acts on.

* server/runtime.py: ``ServerRuntime`` gets the field ``apc_parts``, the patch's parts for this
  server (``integration.parts.Parts``: the lineage runtimes, the boundary finder, the canary,
  the traffic gate), built with it; every server-side edit below reads them from there.
* generate/ar.py, generate/dispatch.py: the batched and single-sequence paths build their
  coordinator through the door (the lineage cache's where it applies); a queued sequence's
  lookup passes its uid (the name of the request's row from the queue to its end), a prompt
  batch's rows are bound by it, and checkpoint stores pass it too. The coordinator's end goes
  through the door too: a batch generator's ``close`` (the server closes an idle one before it
  builds the next) and the end of a single-sequence call close its scope of the runtime's
  book (``hooks.coordinator_closed``: its sessions end and leave the book).
* server/__init__.py: ``apply_chat_template`` also notes each request's system+tools prefix in
  the server's boundary finder.
* server/generation.py: prefill-completed and first-token times go to the coordinator of the
  generator that ran the row (``batch_gen.apc``, passed into the two logging helpers, which are
  static and otherwise see no generator), and so does a cancelled request once the generator
  let it go (a record even with no first token, or one still queued, before its lookup: its
  prompt length is read before the generator drops it).
* server/app.py: /admin is mounted with the server's parts; the lifespan flushes unwritten
  entries to disk at shutdown.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

DOOR = "from server_patch.integration import hooks as _apc_door\n"


def _door_after(name: str, line: str) -> Edit:
    """The door's import, right after ``line`` (one of the file's own imports)."""
    return Edit(name=name, old=line, new=line + DOOR)


# ar.py and dispatch.py both import apc the same way; the door's import goes right after it
# (the copy-free edits in ar.py use it too).
DOOR_IMPORT = _door_after("lineage.door_import", "from .. import apc as _apc\n")

# apc.py's APCManager holds its model's lineage runtime in a field of its own, and its clear()
# (POST /v1/cache/reset: stock's RAM entries go) clears the lineage cache through the door.
MANAGER_PATCH = patch_of(
    "mlx_vlm.apc",
    Edit(
        name="lineage.manager_runtime",
        old="        self.stats = APCStats()\n        self.lock = threading.RLock()\n        self.disk = disk\n",
        new=("        self.stats = APCStats()\n        self.lock = threading.RLock()\n        self.disk = disk\n"
             "        # The lineage cache serving this manager's model (server_patch.integration.runtime).\n"
             "        self.lineage_runtime = None\n"),
    ),
    Edit(
        name="lineage.manager_clear",
        old="            self._exact_cache.clear()\n            self.stats = APCStats()\n\n    def close(self) -> None:\n",
        new=("            self._exact_cache.clear()\n            self.stats = APCStats()\n"
             "        from server_patch.integration import hooks as _apc_door\n\n"
             "        _apc_door.cache_cleared(self)\n\n    def close(self) -> None:\n"),
    ),
)

FILE_PATCHES = (
    MANAGER_PATCH,
    patch_of(
        "mlx_vlm.generate.ar",
        DOOR_IMPORT,
        Edit(
            name="lineage.batch_coordinator",
            old="            _apc.APCCoordinator(apc_manager, model) if apc_manager is not None else None\n",
            new="            _apc_door.coordinator(apc_manager, model) if apc_manager is not None else None\n",
        ),
        Edit(
            name="lineage.store_uid",
            old=(
                "                    self.prompt_cache,\n"
                "                    batch_idx=batch_idx,\n"
                "                    extra_hash=meta.get(\"extra_hash\", 0),\n"
                "                )\n"
                "            else:\n"
            ),
            new=(
                "                    self.prompt_cache,\n"
                "                    batch_idx=batch_idx,\n"
                "                    extra_hash=meta.get(\"extra_hash\", 0),\n"
                "                    uid=self.uids[batch_idx],\n"
                "                )\n"
                "            else:\n"
            ),
        ),
        Edit(
            name="lineage.lookup_uid",
            old="            return coordinator.lookup(ids_list, **lookup_kwargs)\n",
            new="            return _apc_door.lookup(coordinator, ids_list, uid, **lookup_kwargs)\n",
        ),
        Edit(
            name="lineage.generator_closed",
            old=(
                "    def close(self):\n"
                "        if self._wire_stack is not None:\n"
            ),
            new=(
                "    def close(self):\n"
                "        _apc_door.coordinator_closed(getattr(self, \"apc\", None))\n"
                "        if self._wire_stack is not None:\n"
            ),
        ),
        Edit(
            name="lineage.bind_rows",
            old="        self._apc_coordinator = apc_coordinator\n        self._apc_mode = apc_mode\n",
            new=(
                "        self._apc_coordinator = apc_coordinator\n        self._apc_mode = apc_mode\n"
                "        _apc_door.rows_bound(apc_coordinator, self.uids, self._apc_meta)\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.generate.dispatch",
        DOOR_IMPORT,
        Edit(
            name="lineage.single_coordinator",
            old="        apc_coordinator = _apc.APCCoordinator(apc_manager, model.language_model)\n",
            new="        apc_coordinator = _apc_door.coordinator(apc_manager, model.language_model)\n",
        ),
        Edit(
            name="lineage.single_closed",
            old="    with wired_limit(model, [generation_stream]):\n        detokenizer = make_streaming_detokenizer(processor)\n",
            new=(
                "    with wired_limit(model, [generation_stream]), _apc_door.closing(apc_coordinator):\n"
                "        detokenizer = make_streaming_detokenizer(processor)\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.server.runtime",
        _door_after("lineage.parts_import", "from .runtime_config import RuntimeConfig\n"),
        Edit(
            name="lineage.parts",
            old="    config: RuntimeConfig = field(default_factory=RuntimeConfig.from_env)\n",
            new=(
                "    config: RuntimeConfig = field(default_factory=RuntimeConfig.from_env)\n"
                "    # The lineage cache's parts for this server (server_patch.integration.parts):\n"
                "    # its runtimes, boundary finder, canary and traffic gate, built with it.\n"
                "    apc_parts: Any = field(default_factory=_apc_door.build_parts)\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.server",
        Edit(
            name="lineage.anchor_prefix",
            old="from ..prompt_utils import apply_chat_template, extract_text_from_content\n",
            new=(
                "from ..prompt_utils import apply_chat_template, extract_text_from_content\n"
                + DOOR
                + "from .runtime import runtime as _apc_server_runtime\n"
                "\n"
                "apply_chat_template = _apc_door.wrap_apply_chat_template(\n"
                "    apply_chat_template, _apc_server_runtime.apc_parts\n"
                ")\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.server.generation",
        _door_after("lineage.server_door_import",
                    "from ..utils import ThinkingBudgetCriteria, load, prepare_inputs, resolve_eos_token_ids\n"),
        Edit(
            name="lineage.prefill_completed_coordinator",
            old="    def _log_prefill_completed(uid, info: dict, prompt_response) -> None:\n",
            new="    def _log_prefill_completed(uid, info: dict, prompt_response, apc_coordinator=None) -> None:\n",
        ),
        Edit(
            name="lineage.prefill_completed",
            old='        info["prefill_processed"] = prompt_tokens\n',
            new=(
                '        info["prefill_processed"] = prompt_tokens\n'
                "        _apc_door.prefill_completed(apc_coordinator, uid, info, prompt_time)\n"
            ),
        ),
        Edit(
            name="lineage.prefill_completed_call",
            old="                self._log_prefill_completed(prompt_response.uid, info, prompt_response)\n",
            new=(
                "                self._log_prefill_completed(\n"
                "                    prompt_response.uid, info, prompt_response, batch_gen.apc\n"
                "                )\n"
            ),
        ),
        Edit(
            name="lineage.cancelled",
            old=(
                "            if not batch_gen.remove(uid):\n"
                "                self._cancel(uid)\n"
                "                continue\n"
                "            info = active.pop(uid)\n"
            ),
            new=(
                "            _apc_queued = _apc_door.queued_tokens(batch_gen, uid)\n"
                "            if not batch_gen.remove(uid):\n"
                "                self._cancel(uid)\n"
                "                continue\n"
                "            info = active.pop(uid)\n"
                "            _apc_door.cancelled(batch_gen.apc, uid, info, queued_tokens=_apc_queued)\n"
            ),
        ),
        Edit(
            name="lineage.first_token_coordinator",
            old="        token_count: int = 1,\n    ) -> float:\n",
            new="        token_count: int = 1,\n        apc_coordinator=None,\n    ) -> float:\n",
        ),
        Edit(
            name="lineage.first_token",
            old="                max(0.0, now - queued_at),\n            )\n",
            new=(
                "                max(0.0, now - queued_at),\n            )\n"
                "            _apc_door.first_token(\n"
                "                apc_coordinator, uid, request_id, max(0.0, now - queued_at)\n"
                "            )\n"
            ),
        ),
        Edit(
            name="lineage.first_token_call",
            old=(
                "                finish_reason=r.finish_reason,\n"
                "                token_count=token_count,\n"
                "            )\n"
            ),
            new=(
                "                finish_reason=r.finish_reason,\n"
                "                token_count=token_count,\n"
                "                apc_coordinator=batch_gen.apc,\n"
                "            )\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.server.app",
        Edit(
            name="lineage.admin",
            old="    lifespan=lifespan,\n)\n",
            new=(
                "    lifespan=lifespan,\n)\n"
                + DOOR
                + "\n"
                "_apc_door.install_admin(app, runtime.apc_parts)\n"
            ),
        ),
        Edit(
            name="lineage.shutdown_flush",
            old="    try:\n        yield\n    finally:\n        if runtime.audio_queue is not None:\n",
            new=(
                "    try:\n        yield\n    finally:\n"
                "        from server_patch.integration import hooks as _apc_door\n"
                "\n"
                "        _apc_door.shutdown(runtime.apc_parts)\n"
                "        if runtime.audio_queue is not None:\n"
            ),
        ),
    ),
)
