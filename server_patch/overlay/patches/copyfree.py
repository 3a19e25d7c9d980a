"""Copy-free admission and commit: the pool clears become opt-in, and the batch generator
tells the lineage coordinator when a request's KV buffer stops being written.

* generate/ar.py: the ``mx.clear_cache()`` after every prefill chunk (``prompt_step``) and
  after every prompt batch joins decode (three places in ``_next``) call
  ``server_patch.copyfree.hooks.clear``, which clears only with ``APC_POOL_CLEAR=1``;
  ``BatchGenerator`` attaches itself to its coordinator, calls ``joining`` before a prompt
  batch extends the decoding batch, ``GenerationBatch.filter`` calls ``leaving`` before
  rows are dropped, ``GenerationBatch.next`` calls ``decoded`` with the ids each step fed
  (reply reuse: 0.7.10 keeps no generated ids), and ``BatchGenerator.remove`` calls ``removing`` before a row is taken
  out of the prompt batch mid-prefill (a cancelled request).
* server/openai.py: the clear after every non-streaming chat completion and response goes
  through the same opt-in (error paths keep their clears).
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of


_OPENAI_CLEAR = (
    "                from server_patch.copyfree import hooks as _apc_copyfree\n"
    "\n"
    "                _apc_copyfree.clear({site!r})\n"
    "                gc.collect()\n"
)

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.generate.ar",
        Edit(
            name="copyfree.hooks_import",
            old="from ..models import cache\n",
            new="from ..models import cache\nfrom server_patch.copyfree import hooks as _apc_copyfree\n",
        ),
        Edit(
            name="copyfree.prefill_chunk_clear",
            old="        mx.clear_cache()\n        return n\n",
            new="        _apc_copyfree.clear(\"prefill_chunk\")\n        return n\n",
        ),
        Edit(
            name="copyfree.prompt_batch_clear",
            old=(
                "            self._prompt_batch = None\n"
                "            mx.clear_cache()\n"
                "            return prompt_responses, generation_responses\n"
            ),
            new=(
                "            self._prompt_batch = None\n"
                "            _apc_copyfree.clear(\"prompt_batch\")\n"
                "            return prompt_responses, generation_responses\n"
            ),
        ),
        Edit(
            name="copyfree.single_prompt_batch_clear",
            old="                    self._prompt_batch = None\n                    mx.clear_cache()\n",
            new=(
                "                    self._prompt_batch = None\n"
                "                    _apc_copyfree.clear(\"prompt_batch\")\n"
            ),
        ),
        Edit(
            name="copyfree.cold_prompt_batch_clear",
            old=(
                "                self._prompt_batch = None\n"
                "                mx.clear_cache()\n"
                "\n"
                "            return prompt_responses, generation_responses\n"
            ),
            new=(
                "                self._prompt_batch = None\n"
                "                _apc_copyfree.clear(\"prompt_batch\")\n"
                "\n"
                "            return prompt_responses, generation_responses\n"
            ),
        ),
        Edit(
            name="copyfree.rows_leaving",
            old=(
                "        if len(keep) < len(self.uids):\n"
                "            self._eval_pending_state()\n"
                "\n"
                "        self.uids = [self.uids[idx] for idx in keep]\n"
            ),
            new=(
                "        if len(keep) < len(self.uids):\n"
                "            self._eval_pending_state()\n"
                "        _apc_copyfree.leaving(self, keep)\n"
                "\n"
                "        self.uids = [self.uids[idx] for idx in keep]\n"
            ),
        ),
        Edit(
            name="copyfree.rows_decoded",
            old="        tokens, lp_list, top_idx_list, top_lp_list = self._step()\n",
            new=(
                "        tokens, lp_list, top_idx_list, top_lp_list = self._step()\n"
                "        _apc_copyfree.decoded(self, tokens)\n"
            ),
        ),
        Edit(
            name="copyfree.batches_joining",
            old="    def _extend_generation_batch(self, gen_batch) -> None:\n",
            new=(
                "    def _extend_generation_batch(self, gen_batch) -> None:\n"
                "        _apc_copyfree.joining(self, gen_batch)\n"
            ),
        ),
        Edit(
            name="copyfree.prompt_row_removed",
            old=(
                "            if self._prompt_batch is not None and uid in self._prompt_batch.uids:\n"
                "                self._prompt_batch.remove(uid)\n"
            ),
            new=(
                "            if self._prompt_batch is not None and uid in self._prompt_batch.uids:\n"
                "                _apc_copyfree.removing(self, uid)\n"
                "                self._prompt_batch.remove(uid)\n"
            ),
        ),
        Edit(
            name="copyfree.attach_generator",
            old="        self.apc_mode = self.apc.legacy_mode if self.apc is not None else None\n",
            new=(
                "        self.apc_mode = self.apc.legacy_mode if self.apc is not None else None\n"
                "        _apc_copyfree.attach(self)\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.server.openai",
        Edit(
            name="copyfree.chat_request_clear",
            old=(
                "                mx.clear_cache()\n"
                "                gc.collect()\n"
                "\n"
                "                reasoning, content = _split_thinking(\n"
            ),
            new=_OPENAI_CLEAR.format(site="request") + "\n                reasoning, content = _split_thinking(\n",
        ),
        Edit(
            name="copyfree.responses_request_clear",
            old=(
                "                mx.clear_cache()\n"
                "                gc.collect()\n"
                "\n"
                "                output_items, content, reasoning, output_finish_reason = (\n"
            ),
            new=_OPENAI_CLEAR.format(site="request")
            + "\n                output_items, content, reasoning, output_finish_reason = (\n",
        ),
    ),
)
