"""Concurrent disk restores under RAM pressure, on a real server (issue 34 item 5).

Agents resuming after a restart: every conversation's entry is on disk only, and more
continuations arrive at once than the RAM budget holds entries, while another stream decodes.
Each file loaded for a queued request used to be promoted into RAM at once, and the promotions
evicted each other before their requests were admitted (8 continuations: 6 waited in LOADING,
then prefilled cold). Now the request holds its entry from before the read until its admission
(``lineage.holds``), loads beyond the budget wait their turn, and every request whose entry alone
fits the budget restores from disk.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_e2e_disk import _env, _files, _stop_gracefully
from tests.e2e.test_e2e_disk_loading import _records
from tests.integration.test_pacing import Stream
from tests.server_harness import PatchedServer, fed_tokens, prompt_tokens, reply_text, reply_tokens, text

CONVERSATIONS = 6
TENANT = "resuming"
PARAMS = {"max_tokens": 6, "logprobs": True, "top_logprobs": 5}
SYSTEM = text(120, 3601)  # one system prompt: one anchor for all


class Continuation(threading.Thread):
    def __init__(self, server: PatchedServer, messages: list[dict], start_line: threading.Barrier) -> None:
        super().__init__(daemon=True)
        self.server, self.messages, self.start_line = server, messages, start_line
        self.answer: dict[str, Any] | None = None

    def run(self) -> None:
        self.start_line.wait(60)
        self.answer = self.server.chat(self.messages, tenant=TENANT, **PARAMS)


def _first_turns(tiny_model_dir: Path, disk: Path, log_dir: Path) -> list[tuple[dict, list[dict]]]:
    """Each conversation's first answer and its continuation, its entry written to ``disk`` by a
    first server (its shutdown flush)."""
    server = PatchedServer(tiny_model_dir, env=_env(disk), log_dir=log_dir)
    turns = []
    try:
        server.start()
        for i in range(CONVERSATIONS):
            turn0 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text(300 + 9 * i, 3610 + i)}]
            answer = server.chat(turn0, tenant=TENANT, **PARAMS)
            turns.append((answer, turn0 + [{"role": "assistant", "content": reply_text(answer)},
                                           {"role": "user", "content": text(40, 3630 + i)}]))
    finally:
        _stop_gracefully(server)
    return turns


@pytest.mark.server
def test_more_continuations_than_the_budget_holds_all_restore_from_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "lineage-disk"
    turns = _first_turns(tiny_model_dir, disk, tmp_path / "one")
    largest = max(f.stat().st_size for f in _files(disk))
    budget = largest * 5 // 2  # each entry fits alone; not three of them
    env = _env(disk, APC_LINEAGE_RAM_BUDGET_BYTES=str(budget), APC_STAGE_MIN_TOKENS="16")
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "two") as server:
        stream = Stream(server, max_tokens=300, seed=3650)  # another session decodes meanwhile
        stream.start()
        assert stream.decoding.wait(120)
        start_line = threading.Barrier(CONVERSATIONS)
        continuations = [Continuation(server, messages, start_line) for _, messages in turns]
        for c in continuations:
            c.start()
        for c in continuations:
            c.join(600)
        stream.join(300)
        assert all(c.answer is not None for c in continuations), server.log_tail()

        by_prompt = {prompt_tokens(c.answer): c for c in continuations}
        assert len(by_prompt) == CONVERSATIONS  # the conversations' prompts differ in length
        records = [r for r in _records(server) if r["prompt_tokens"] in by_prompt]
        assert len(records) == CONVERSATIONS, records
        cold = [r for r in records if r["restore_kind"] != "disk"]
        assert not cold, [(r["restore_kind"], r["lost"], r["lost_why"]) for r in cold]
        for (first, _), c in zip(turns, continuations):  # each past its own first reply
            (record,) = [r for r in records if r["prompt_tokens"] == prompt_tokens(c.answer)]
            assert record["restored_tokens"] == fed_tokens(first), record

        for _, messages in turns:  # admitted while others decode: greedy tokens equal a cold prefill's
            warm = next(c.answer for c in continuations if c.messages is messages)
            cold_answer = server.chat(messages, tenant=f"cold-{uuid.uuid4().hex[:8]}", **PARAMS)
            assert reply_tokens(warm) == reply_tokens(cold_answer)
