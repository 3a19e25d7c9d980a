"""Disk loads off the generation thread (``server_patch.integration.loading``): a queued prompt
whose restore point is a disk file waits in the queue, its file loading, while the batch decodes.

* generate/ar.py ``BatchGenerator._next``: before it takes up to ``prefill_batch_size`` queued
  sequences, the door's ``admissible`` says how many (the queue reordered: those still loading
  behind); none: no prompt batch this step, the decode steps go on;
* generate/ar.py ``BatchGenerator._next``, first thing every step (also while the batch is full
  or a multi-chunk prefill runs, when ``admissible`` is not reached): with prompts queued, the
  door's ``prefetch`` starts their disk loads and staged copies without admitting them.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.generate.ar",
        Edit(
            name="loading.prefetch",
            old=(
                "    def _next(self, **kwargs):\n"
                "        generation_responses = []\n"
                "        prompt_responses = []\n"
            ),
            new=(
                "    def _next(self, **kwargs):\n"
                "        generation_responses = []\n"
                "        prompt_responses = []\n"
                "        if self._unprocessed_sequences:\n"
                "            _apc_door.prefetch(self)\n"
            ),
        ),
        Edit(
            name="loading.admissible",
            old=(
                "        if self._unprocessed_sequences and num_to_add >= self.prefill_batch_size:\n"
                "            # Take up to prefill_batch_size pending sequences. If APC is on\n"
                "            # and at least one of them has a prefix hit, build a mixed\n"
                "            # warm/cold PromptProcessingBatch with right-padded suffixes so\n"
                "            # warm and cold rows prefill in a single forward pass.\n"
                "            n = min(self.prefill_batch_size, len(self._unprocessed_sequences))\n"
            ),
            new=(
                "        if (\n"
                "            self._unprocessed_sequences\n"
                "            and num_to_add >= self.prefill_batch_size\n"
                "            and (_apc_ready := _apc_door.admissible(\n"
                "                getattr(self, \"apc\", None), self._unprocessed_sequences,\n"
                "                self._apc_extra_hash, self.prefill_batch_size, decoding=num_active))\n"
                "        ):\n"
                "            # Take up to prefill_batch_size pending sequences. If APC is on\n"
                "            # and at least one of them has a prefix hit, build a mixed\n"
                "            # warm/cold PromptProcessingBatch with right-padded suffixes so\n"
                "            # warm and cold rows prefill in a single forward pass.\n"
                "            n = _apc_ready\n"
            ),
        ),
    ),
)
