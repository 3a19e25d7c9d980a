"""The lineage cache's hooks into mlx-vlm 0.7.10: each edit only calls into server_patch.

* generate/ar.py, generate/dispatch.py: the batched and single-sequence paths build our
  coordinator; the batch passes each row's uid to checkpoint stores and binds timing records.
* server/__init__.py: ``apply_chat_template`` also notes each request's system+tools prefix.
* server/generation.py: prefill-completed and first-token times go to the timing records, and
  so does a cancelled request once the generator let it go (a record even with no first token,
  or one still queued, before its lookup: its prompt length is read before the generator drops it).
* server/app.py: /admin is mounted; the lifespan flushes unwritten entries to disk at shutdown.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of


_COORDINATOR_FACTORY = (
    "\n\ndef _apc_lineage_coordinator(manager, model):\n"
    "    from server_patch.integration.coordinator import LineageCoordinator\n"
    "\n"
    "    return LineageCoordinator(manager, model)\n"
)

# ar.py and dispatch.py both import apc the same way; the factory goes right after it.
COORDINATOR_FACTORY = Edit(
    name="lineage.coordinator_factory",
    old="from .. import apc as _apc\n",
    new="from .. import apc as _apc\n" + _COORDINATOR_FACTORY,
)

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.generate.ar",
        COORDINATOR_FACTORY,
        Edit(
            name="lineage.batch_coordinator",
            old="            _apc.APCCoordinator(apc_manager, model) if apc_manager is not None else None\n",
            new="            _apc_lineage_coordinator(apc_manager, model) if apc_manager is not None else None\n",
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
            name="lineage.bind_rows",
            old="        self._apc_coordinator = apc_coordinator\n        self._apc_mode = apc_mode\n",
            new=(
                "        self._apc_coordinator = apc_coordinator\n        self._apc_mode = apc_mode\n"
                "        if apc_coordinator is not None and hasattr(apc_coordinator, \"bind_rows\"):\n"
                "            apc_coordinator.bind_rows(self.uids, self._apc_meta)\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.generate.dispatch",
        COORDINATOR_FACTORY,
        Edit(
            name="lineage.single_coordinator",
            old="        apc_coordinator = _apc.APCCoordinator(apc_manager, model.language_model)\n",
            new="        apc_coordinator = _apc_lineage_coordinator(apc_manager, model.language_model)\n",
        ),
    ),
    patch_of(
        "mlx_vlm.server",
        Edit(
            name="lineage.anchor_prefix",
            old="from ..prompt_utils import apply_chat_template, extract_text_from_content\n",
            new=(
                "from ..prompt_utils import apply_chat_template, extract_text_from_content\n"
                "from server_patch.integration.segments import wrap_apply_chat_template as _apc_wrap\n"
                "\n"
                "apply_chat_template = _apc_wrap(apply_chat_template)\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.server.generation",
        Edit(
            name="lineage.hooks_import",
            old="from ..utils import ThinkingBudgetCriteria, load, prepare_inputs, resolve_eos_token_ids\n",
            new=(
                "from ..utils import ThinkingBudgetCriteria, load, prepare_inputs, resolve_eos_token_ids\n"
                "from server_patch.integration import hooks as _apc_lineage_hooks\n"
            ),
        ),
        Edit(
            name="lineage.prefill_completed",
            old='        info["prefill_processed"] = prompt_tokens\n',
            new=(
                '        info["prefill_processed"] = prompt_tokens\n'
                "        _apc_lineage_hooks.prefill_completed(uid, info, prompt_time)\n"
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
                "            _apc_queued = _apc_lineage_hooks.queued_tokens(batch_gen, uid)\n"
                "            if not batch_gen.remove(uid):\n"
                "                self._cancel(uid)\n"
                "                continue\n"
                "            info = active.pop(uid)\n"
                "            _apc_lineage_hooks.cancelled(uid, info, queued_tokens=_apc_queued)\n"
            ),
        ),
        Edit(
            name="lineage.first_token",
            old="                max(0.0, now - queued_at),\n            )\n",
            new=(
                "                max(0.0, now - queued_at),\n            )\n"
                "            _apc_lineage_hooks.first_token(uid, request_id, max(0.0, now - queued_at))\n"
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
                "from server_patch.admin.api import install as _apc_admin_install\n"
                "\n"
                "_apc_admin_install(app)\n"
            ),
        ),
        Edit(
            name="lineage.shutdown_flush",
            old="    try:\n        yield\n    finally:\n        if runtime.audio_queue is not None:\n",
            new=(
                "    try:\n        yield\n    finally:\n"
                "        from server_patch.integration import hooks as _apc_lineage_hooks\n"
                "\n"
                "        _apc_lineage_hooks.shutdown()\n"
                "        if runtime.audio_queue is not None:\n"
            ),
        ),
    ),
)
