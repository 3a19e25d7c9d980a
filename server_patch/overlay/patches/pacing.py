"""Decode-aware prefill (``server_patch/pacing.py``): while other rows decode, a prefill chunk
is sized to ``APC_DECODE_STALL_MS``.

* generate/ar.py ``PromptProcessingBatch.prompt_step``: the chunk size goes through
  ``pacing.chunk`` (mlx-vlm's full chunk unless rows decode meanwhile);
* generate/ar.py ``BatchGenerator._next``: its three ``prompt_step()`` calls go through
  ``pacing.step``, which tells the batch how many rows decode and measures the chunk's rate.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

_HOOK = "from server_patch import pacing as _apc_pacing\n"

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.generate.ar",
        Edit(
            name="pacing.import",
            old="from ..kv_quant import from_legacy as kv_quant_from_legacy\n",
            new="from ..kv_quant import from_legacy as kv_quant_from_legacy\n" + _HOOK,
        ),
        Edit(
            name="pacing.chunk",
            old="        step = self.prefill_step_size or self._inputs_embeds.shape[1]\n",
            new="        step = _apc_pacing.chunk(self, self.prefill_step_size or self._inputs_embeds.shape[1])\n",
        ),
        Edit(
            name="pacing.step_continue",
            old="                self._prompt_batch.prompt_step()\n",
            new="                _apc_pacing.step(self, self._prompt_batch)\n",
        ),
        Edit(
            name="pacing.step_mixed",
            old="                    nstep = self._prompt_batch.prompt_step()\n",
            new="                    nstep = _apc_pacing.step(self, self._prompt_batch)\n",
        ),
        Edit(
            name="pacing.step_cold",
            old="                n = self._prompt_batch.prompt_step()\n",
            new="                n = _apc_pacing.step(self, self._prompt_batch)\n",
        ),
    ),
)
