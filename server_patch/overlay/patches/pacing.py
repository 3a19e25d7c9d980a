"""Decode-aware prefill (``server_patch/pacing.py``): while other rows decode, a prefill chunk
is sized to ``APC_DECODE_STALL_MS``.

* generate/ar.py ``PromptProcessingBatch.prompt_step``: a ``max_tokens`` argument, at most that
  many prompt columns this step (a model that cannot chunk keeps its one whole step); called
  without it, mlx-vlm's full chunk as before;
* generate/ar.py ``BatchGenerator._next``: its three ``prompt_step()`` calls go through the one
  door (``integration.hooks.prefill_step``; the lineage topic's ``lineage.door_import`` imports
  it into ar.py), which sizes the step while rows decode and
  measures its cost (``server_patch.pacing``). Nothing is set on mlx-vlm's objects.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.generate.ar",
        Edit(
            name="pacing.max_tokens",
            old=("    def prompt_step(self) -> int:\n"
                 "        \"\"\"Process one chunk of the prompt. Returns tokens processed.\"\"\"\n"),
            new=("    def prompt_step(self, max_tokens: Optional[int] = None) -> int:\n"
                 "        \"\"\"Process one chunk of the prompt (at most ``max_tokens`` columns, where the\n"
                 "        model prefills in chunks). Returns tokens processed.\"\"\"\n"),
        ),
        Edit(
            name="pacing.chunk",
            old="        step = self.prefill_step_size or self._inputs_embeds.shape[1]\n",
            new=("        step = self.prefill_step_size or self._inputs_embeds.shape[1]\n"
                 "        if max_tokens is not None and self.prefill_step_size:\n"
                 "            step = min(step, max_tokens)\n"),
        ),
        Edit(
            name="pacing.step_continue",
            old="                self._prompt_batch.prompt_step()\n",
            new="                _apc_door.prefill_step(self, self._prompt_batch)\n",
        ),
        Edit(
            name="pacing.step_mixed",
            old="                    nstep = self._prompt_batch.prompt_step()\n",
            new="                    nstep = _apc_door.prefill_step(self, self._prompt_batch)\n",
        ),
        Edit(
            name="pacing.step_cold",
            old="                n = self._prompt_batch.prompt_step()\n",
            new="                n = _apc_door.prefill_step(self, self._prompt_batch)\n",
        ),
    ),
)
