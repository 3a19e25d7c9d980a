"""Copy-free admission and commit: the pool clears become opt-in, and the batch generator
tells the lineage coordinator when a request's KV buffer stops being written.

Every edit calls the one door, ``server_patch.integration.hooks`` (``_apc_door``; the lineage
topic's ``lineage.door_import`` imports it into ar.py), and hands it the coordinator:

* generate/ar.py: the ``mx.clear_cache()`` after every prefill chunk (``prompt_step``) and
  after every prompt batch joins decode (three places in ``_next``) call ``clear``, which
  clears only with ``APC_POOL_CLEAR=1``. ``BatchGenerator`` introduces itself to its
  coordinator (``self.apc``) once built, and tells it before a prompt batch joins the decoding
  batch and before a row leaves the prompt batch mid-prefill (a cancelled request).
* generate/ar.py, ``GenerationBatch``: a batch is built with the coordinator of the prompt
  batch it came from (a constructor argument, ``apc_coordinator``, as ``PromptProcessingBatch``
  has one; the empty starting batch has none), so ``filter`` can say which rows leave and
  ``next`` which ids each step fed (reply reuse: 0.7.10 keeps no generated ids). A batch that
  knows its coordinator from birth reads better upstream than one handed it by the generator
  later, and needs no attribute set from outside the class. A finished prompt batch asks the
  door before it joins (``join_waits``): while the runtime's stager is still making its join's
  buffers, the join waits and the rows decode on. A lone stream's single-row caches join
  through the door (``one_row``), without mlx-vlm's merge copy first.
* server/openai.py: the clear after every non-streaming chat completion and response goes
  through the same opt-in (error paths keep their clears).
* models/cache.py: ``BatchKVCache.extend`` and ``filter`` (a row joining or leaving the decoding
  batch) ask the door (``kv_rows_join``, ``kv_rows_leave``) to hand a plain ``BatchKVCache`` to
  ``server_patch.copyfree.batch``, which moves each row once at its own width (issue 40);
  ``APC_COPYFREE=0`` or ``APC_COPYFREE_JOIN=0`` keeps mlx-vlm's methods. A leave may keep the
  rows in place (a view of the old buffer, recorded on the cache as ``_apc_row_view``): then
  ``update_and_fetch`` hands the write to the door (``kv_rows_write``), which writes into the old
  buffer in place. So does a write the buffer is too small for (a regrow): the door grows it
  into a buffer made ahead (``copyfree.grow``, ``APC_COPYFREE_GROW``). Any other write is
  stock's, at the cost of one attribute read and one comparison.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of


_OPENAI_CLEAR = (
    "                from server_patch.integration import hooks as _apc_door\n"
    "\n"
    "                _apc_door.clear({site!r})\n"
    "                gc.collect()\n"
)

# A plain BatchKVCache's join or leave, through the door when APC_COPYFREE is on (imported at
# the call: cache.py is imported before server_patch can be).
_BATCH_DOOR = (
    "        from server_patch.integration import hooks as _apc_door\n"
    "\n"
    "        if _apc_door.{call}:\n"
    "            return\n"
    "\n"
)

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.generate.ar",
        Edit(
            name="copyfree.batch_coordinator_argument",
            old=(
                "        thinking_budget_criteria: Optional[List[Any]] = None,\n"
                "    ):\n"
                "        self.model = model\n"
                "        self._language_model = getattr(model, \"language_model\", model)\n"
            ),
            new=(
                "        thinking_budget_criteria: Optional[List[Any]] = None,\n"
                "        apc_coordinator: Optional[Any] = None,\n"
                "    ):\n"
                "        self.model = model\n"
                "        self._language_model = getattr(model, \"language_model\", model)\n"
                "        # The APC coordinator of the generator this batch decodes for: ``filter``\n"
                "        # and ``next`` tell it which rows leave and which ids each step fed.\n"
                "        self.apc_coordinator = apc_coordinator\n"
            ),
        ),
        Edit(
            name="copyfree.empty_batch_coordinator",
            old="        batch.thinking_budget_criteria = []\n",
            new="        batch.thinking_budget_criteria = []\n        batch.apc_coordinator = None\n",
        ),
        Edit(
            name="copyfree.batch_built_with_coordinator",
            old=(
                "                thinking_budget_criteria=list(self.thinking_budget_criteria),\n"
                "            )\n"
                "        gen_batch.compute_logprobs = compute_logprobs\n"
            ),
            new=(
                "                thinking_budget_criteria=list(self.thinking_budget_criteria),\n"
                "                apc_coordinator=self._apc_coordinator,\n"
                "            )\n"
                "        gen_batch.compute_logprobs = compute_logprobs\n"
            ),
        ),
        Edit(
            name="copyfree.prefill_chunk_clear",
            old="        mx.clear_cache()\n        return n\n",
            new="        _apc_door.clear(\"prefill_chunk\")\n        return n\n",
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
                "            _apc_door.clear(\"prompt_batch\")\n"
                "            return prompt_responses, generation_responses\n"
            ),
        ),
        Edit(
            name="copyfree.single_prompt_batch_clear",
            old="                    self._prompt_batch = None\n                    mx.clear_cache()\n",
            new=(
                "                    self._prompt_batch = None\n"
                "                    _apc_door.clear(\"prompt_batch\")\n"
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
                "                _apc_door.clear(\"prompt_batch\")\n"
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
                "        _apc_door.rows_leaving(self.apc_coordinator, self, keep)\n"
                "\n"
                "        self.uids = [self.uids[idx] for idx in keep]\n"
            ),
        ),
        Edit(
            name="copyfree.rows_decoded",
            old="        tokens, lp_list, top_idx_list, top_lp_list = self._step()\n",
            new=(
                "        tokens, lp_list, top_idx_list, top_lp_list = self._step()\n"
                "        _apc_door.rows_decoded(self.apc_coordinator, self, tokens)\n"
            ),
        ),
        Edit(
            name="copyfree.batches_joining",
            old="    def _extend_generation_batch(self, gen_batch) -> None:\n",
            new=(
                "    @_apc_door.batch_join\n"
                "    def _extend_generation_batch(self, gen_batch) -> None:\n"
                "        _apc_door.batches_joining(self.apc, self._generation_batch, gen_batch)\n"
            ),
        ),
        # Each a unit of ``integration.waits``, timed to the end of its compute: the joint decode
        # step, rows leaving the batch, a prompt batch's last forward (issue 40).
        Edit(
            name="copyfree.decode_step_timed",
            old="    def next(self) -> List[Response]:\n        \"\"\"Generate the next batch of tokens.\"\"\"\n",
            new=("    @_apc_door.decode_step\n"
                 "    def next(self) -> List[Response]:\n        \"\"\"Generate the next batch of tokens.\"\"\"\n"),
        ),
        # A finished prompt batch whose join's buffers the stager is still making waits (the
        # rows decode on) instead of having them allocated on the thread (issue 40).
        Edit(
            name="copyfree.join_waits_for_its_buffers",
            old=("                self._record_prompt_batch_time(self._prompt_batch, elapsed)\n"
                 "                return prompt_responses, generation_responses\n"
                 "\n"
                 "            tic = time.perf_counter()\n"
                 "            gen_batch = self._prompt_batch.generate(\n"),
            new=("                self._record_prompt_batch_time(self._prompt_batch, elapsed)\n"
                 "                return prompt_responses, generation_responses\n"
                 "\n"
                 "            if _apc_door.join_waits(self, self._prompt_batch):\n"
                 "                return prompt_responses, generation_responses\n"
                 "\n"
                 "            tic = time.perf_counter()\n"
                 "            gen_batch = self._prompt_batch.generate(\n"),
        ),
        # A lone stream's single-row caches join without a copy (issue 40): mlx-vlm merges each
        # into a fresh batch buffer first, which the join then copies again.
        Edit(
            name="copyfree.one_row_joins_uncopied",
            old=("        if not _is_batch_cache_entry(ca) and hasattr(ca.__class__, \"merge\"):\n"
                 "            ca = ca.__class__.merge([ca])\n"
                 "        if not _is_batch_cache_entry(cb) and hasattr(cb.__class__, \"merge\"):\n"
                 "            cb = cb.__class__.merge([cb])\n"),
            new=("        if not _is_batch_cache_entry(ca) and hasattr(ca.__class__, \"merge\"):\n"
                 "            ca = _apc_door.one_row(ca)\n"
                 "        if not _is_batch_cache_entry(cb) and hasattr(cb.__class__, \"merge\"):\n"
                 "            cb = _apc_door.one_row(cb)\n"),
        ),
        Edit(
            name="copyfree.rows_leave_timed",
            old=("    def filter(self, keep: List[int]):\n"
                 "        \"\"\"Filter the batch to keep only the specified indices.\"\"\"\n"),
            new=("    @_apc_door.rows_leave\n"
                 "    def filter(self, keep: List[int]):\n"
                 "        \"\"\"Filter the batch to keep only the specified indices.\"\"\"\n"),
        ),
        Edit(
            name="copyfree.prompt_generation_timed",
            old=("    def generate(\n"
                 "        self, sampler, stop_criteria, compute_logprobs=True, top_logprobs_k=0\n"
                 "    ) -> GenerationBatch:\n"),
            new=("    @_apc_door.prompt_generation\n"
                 "    def generate(\n"
                 "        self, sampler, stop_criteria, compute_logprobs=True, top_logprobs_k=0\n"
                 "    ) -> GenerationBatch:\n"),
        ),
        Edit(
            name="copyfree.prompt_row_removed",
            old=(
                "            if self._prompt_batch is not None and uid in self._prompt_batch.uids:\n"
                "                self._prompt_batch.remove(uid)\n"
            ),
            new=(
                "            if self._prompt_batch is not None and uid in self._prompt_batch.uids:\n"
                "                _apc_door.request_removed(self.apc, uid)\n"
                "                self._prompt_batch.remove(uid)\n"
            ),
        ),
        Edit(
            name="copyfree.attach_generator",
            old="        self.apc_mode = self.apc.legacy_mode if self.apc is not None else None\n",
            new=(
                "        self.apc_mode = self.apc.legacy_mode if self.apc is not None else None\n"
                "        _apc_door.generator_started(self.apc, self)\n"
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
    patch_of(
        "mlx_vlm.models.cache",
        Edit(
            name="copyfree.batch_rows_leave",
            old=(
                "        In-place filter to keep just the given indices in the cache.\n"
                "        \"\"\"\n"
                "        if self.keys is not None:\n"
                "            self.keys = self.keys[batch_indices]\n"
                "            self.values = self.values[batch_indices]\n"
                "        self.offset = self.offset[batch_indices]\n"
                "        self.left_padding = self.left_padding[batch_indices]\n"
                "        if self._right_padding is not None:\n"
            ),
            new=(
                "        In-place filter to keep just the given indices in the cache.\n"
                "        \"\"\"\n"
                + _BATCH_DOOR.format(call="kv_rows_leave(self, batch_indices)")
                + "        if self.keys is not None:\n"
                "            self.keys = self.keys[batch_indices]\n"
                "            self.values = self.values[batch_indices]\n"
                "        self.offset = self.offset[batch_indices]\n"
                "        self.left_padding = self.left_padding[batch_indices]\n"
                "        if self._right_padding is not None:\n"
            ),
        ),
        Edit(
            name="copyfree.batch_rows_write",
            old=(
                "    def update_and_fetch(self, keys, values):\n"
                "        prev = self._idx\n"
                "        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:\n"
                "            B, n_kv_heads, _, k_head_dim = keys.shape\n"
            ),
            new=(
                "    def update_and_fetch(self, keys, values):\n"
                "        if getattr(self, \"_apc_row_view\", None) is not None or (\n"
                "            self.keys is not None and self._idx + keys.shape[2] > self.keys.shape[2]\n"
                "        ):\n"
                "            from server_patch.integration import hooks as _apc_door\n"
                "\n"
                "            _apc_fetched = _apc_door.kv_rows_write(self, keys, values)\n"
                "            if _apc_fetched is not None:\n"
                "                return _apc_fetched\n"
                "        prev = self._idx\n"
                "        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:\n"
                "            B, n_kv_heads, _, k_head_dim = keys.shape\n"
            ),
        ),
        Edit(
            name="copyfree.batch_rows_join",
            old=(
                "        In-place extend this cache with the other cache.\n"
                "        \"\"\"\n"
                "        if self.keys is None and other.keys is None:\n"
                "            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])\n"
                "            self.offset = mx.concatenate([self.offset, other.offset])\n"
                "            return\n"
                "\n"
                "        max_idx = max(self._idx, other._idx)\n"
            ),
            new=(
                "        In-place extend this cache with the other cache.\n"
                "        \"\"\"\n"
                + _BATCH_DOOR.format(call="kv_rows_join(self, other)")
                + "        if self.keys is None and other.keys is None:\n"
                "            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])\n"
                "            self.offset = mx.concatenate([self.offset, other.offset])\n"
                "            return\n"
                "\n"
                "        max_idx = max(self._idx, other._idx)\n"
            ),
        ),
    ),
)
