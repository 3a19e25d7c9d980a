"""Speculative decoding: each verified round is told to the lineage coordinator, so a row's
entry can move past its reply under a drafter exactly as it does without one.

mlx-vlm 0.7.10's ``SpeculativeGenerationBatch`` keeps no fed ids, and its caches take draft
rows that ``commit_speculative_round`` trims (KV) and rolls back (recurrent state). After that
commit, row ``j`` of the batch's caches holds what it held before plus exactly
``verify_input[j, :accepted[j] + 1]`` (the bonus and the accepted drafts; the target's own
next token is emitted, not fed). So the round loop reports, right after the commit and
outside its abort guard, ``(verify_input, accepted, active_idx)`` (the rows still verified,
as indices into the batch's ``_all_uids``), and the batch says which rows just finished,
before its cache can be filtered or released. Every call goes through the one door,
``server_patch.integration.hooks`` (``speculative_round``, ``speculative_rows_leaving``),
with the batch's coordinator, a constructor argument as ``GenerationBatch`` has
(``copyfree.batch_coordinator_argument``):

* generate/ar.py, ``SpeculativeGenerationBatch``: built with the prompt batch's coordinator;
  ``_start_rounds`` hands the round loop a callback bound to the batch; ``_refresh_uids``
  (after every ``next`` and ``filter``) names the rows that finished first;
* speculative/utils.py, ``run_speculative_server_rounds``: passes the callback to the MTP loop
  (the only draft kind the lineage serves, ``server_patch.speculative.support``);
* speculative/mtp.py, ``_mtp_rounds_batch``: calls it after each committed round.
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.generate.ar",
        Edit(
            name="speculative.batch_coordinator_argument",
            old=(
                "        greedy_sampling: bool = False,\n"
                "    ):\n"
                "        self.model = model\n"
                "        self.draft_model = draft_model\n"
                "        self.draft_kind = draft_kind\n"
                "        self.uids = list(uids)\n"
            ),
            new=(
                "        greedy_sampling: bool = False,\n"
                "        apc_coordinator: Optional[Any] = None,\n"
                "    ):\n"
                "        self.model = model\n"
                "        self.draft_model = draft_model\n"
                "        self.draft_kind = draft_kind\n"
                "        # The APC coordinator this batch decodes for: each verified round and each\n"
                "        # finished row are told to it (reply reuse under speculation).\n"
                "        self.apc_coordinator = apc_coordinator\n"
                "        self.uids = list(uids)\n"
            ),
        ),
        Edit(
            name="speculative.batch_built_with_coordinator",
            old=(
                "                greedy_sampling=self.greedy_sampling,\n"
                "            )\n"
                "            compute_logprobs = False\n"
            ),
            new=(
                "                greedy_sampling=self.greedy_sampling,\n"
                "                apc_coordinator=self._apc_coordinator,\n"
                "            )\n"
                "            compute_logprobs = False\n"
            ),
        ),
        Edit(
            name="speculative.rows_finished",
            old="    def _refresh_uids(self):\n        self.uids = [\n",
            new=(
                "    def _refresh_uids(self):\n"
                "        _apc_door.speculative_rows_leaving(\n"
                "            self.apc_coordinator,\n"
                "            self,\n"
                "            [u for u, done in zip(self._all_uids, self._finished) if done and u in self.uids],\n"
                "        )\n"
                "        self.uids = [\n"
            ),
        ),
        Edit(
            name="speculative.round_callback",
            old=(
                "            prompt_tokens=self.prompt_tokens,\n"
                "            row_ids=[0] * len(self._all_uids),\n"
                "        )\n"
            ),
            new=(
                "            prompt_tokens=self.prompt_tokens,\n"
                "            row_ids=[0] * len(self._all_uids),\n"
                "            apc_round=lambda *verified: _apc_door.speculative_round(\n"
                "                self.apc_coordinator, self, *verified\n"
                "            ),\n"
                "        )\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.speculative.utils",
        Edit(
            name="speculative.rounds_callback_argument",
            old=(
                "    prompt_tokens: Optional[mx.array] = None,\n"
                "    row_ids: Optional[List[int]] = None,\n"
                ") -> Generator[Tuple[List[Optional[int]], None], None, None]:\n"
            ),
            new=(
                "    prompt_tokens: Optional[mx.array] = None,\n"
                "    row_ids: Optional[List[int]] = None,\n"
                "    apc_round: Optional[Callable[..., None]] = None,\n"
                ") -> Generator[Tuple[List[Optional[int]], None], None, None]:\n"
            ),
        ),
        Edit(
            name="speculative.mtp_rounds_callback",
            old=(
                "            greedy_sampling=greedy_sampling,\n"
                "            row_ids=row_ids,\n"
                "        )\n"
                "        return\n"
                "\n"
                "    if draft_kind == \"dflash\":\n"
            ),
            new=(
                "            greedy_sampling=greedy_sampling,\n"
                "            row_ids=row_ids,\n"
                "            apc_round=apc_round,\n"
                "        )\n"
                "        return\n"
                "\n"
                "    if draft_kind == \"dflash\":\n"
            ),
        ),
    ),
    patch_of(
        "mlx_vlm.speculative.mtp",
        Edit(
            name="speculative.mtp_callback_argument",
            old=(
                "    row_ids: Optional[List[int]] = None,\n"
                ") -> Generator[Tuple[List[Optional[int]], None], None, None]:\n"
                "    \"\"\"Batched Gemma 4 MTP round loop"
            ),
            new=(
                "    row_ids: Optional[List[int]] = None,\n"
                "    apc_round: Optional[Callable[..., None]] = None,\n"
                ") -> Generator[Tuple[List[Optional[int]], None], None, None]:\n"
                "    \"\"\"Batched Gemma 4 MTP round loop"
            ),
        ),
        Edit(
            name="speculative.round_committed",
            old=(
                "            if callable(abort_draft):\n"
                "                abort_draft()\n"
                "            raise\n"
                "\n"
                "        # Per-row hidden: each row picks its own accepted slot from\n"
            ),
            new=(
                "            if callable(abort_draft):\n"
                "                abort_draft()\n"
                "            raise\n"
                "        if apc_round is not None:  # the round is committed: what each row's cache took\n"
                "            apc_round(verify_input, accepted_list, active_idx)\n"
                "\n"
                "        # Per-row hidden: each row picks its own accepted slot from\n"
            ),
        ),
    ),
)
