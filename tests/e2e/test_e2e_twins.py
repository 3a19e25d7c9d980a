"""Issue 35's twins on a real server: identical prompts sent at once, with different
``max_tokens``, while the generation thread is busy with another stream.

Parallel sub-agents started from one prompt, best-of-n and a double-clicked regenerate all send
this. Before the request's row was keyed by mlx-vlm's uid, twins admitted in one prompt batch
collapsed into one record (2 or 3 records for 4 requests), and a twin's follow-up turn restored
another twin's shorter reply. Now: one record each, each follow-up (its own reply appended)
restores past its own reply, and every answer equals a cold one.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_e2e_disk_loading import _records
from tests.integration.test_pacing import Stream
from tests.server_harness import (PatchedServer, assert_same_output, cached_tokens, fed_tokens, prompt_tokens,
                                  reply_text, reply_tokens, text)

TENANT = "twins"
LIMITS = (5, 9, 14)  # each twin's max_tokens: greedy replies, each a prefix of the next


class Twin(threading.Thread):
    def __init__(self, server: PatchedServer, messages: list[dict], max_tokens: int,
                 start_line: threading.Barrier) -> None:
        super().__init__(daemon=True)
        self.server, self.messages, self.max_tokens, self.start_line = server, messages, max_tokens, start_line
        self.answer: dict[str, Any] | None = None

    def run(self) -> None:
        self.start_line.wait(60)
        self.answer = self.server.chat(self.messages, tenant=TENANT, max_tokens=self.max_tokens,
                                       logprobs=True, top_logprobs=5)


def _cold(server: PatchedServer, messages: list[dict], max_tokens: int) -> dict:
    """The same request prefilled cold (a tenant of its own shares no entry)."""
    answer, line = server.chat_restore(messages, tenant=f"cold-{uuid.uuid4().hex[:8]}", max_tokens=max_tokens,
                                       logprobs=True, top_logprobs=5)
    assert line["kind"] == "cold", line
    return answer


@pytest.mark.server
def test_identical_prompts_at_once_are_separate_records_each_restoring_its_own_reply(tiny_model_dir: Path,
                                                                                     tmp_path: Path) -> None:
    messages = [{"role": "system", "content": text(200, 3501)}, {"role": "user", "content": text(80, 3502)}]
    with PatchedServer(tiny_model_dir, env={"TOP_LOGPROBS_K": "5"}, log_dir=tmp_path) as server:
        stream = Stream(server, max_tokens=400, seed=3503)  # the generation thread is busy decoding
        stream.start()
        assert stream.decoding.wait(120)
        start_line = threading.Barrier(len(LIMITS))
        twins = [Twin(server, messages, n, start_line) for n in LIMITS]
        for twin in twins:
            twin.start()
        for twin in twins:
            twin.join(300)
        stream.join(300)
        answers = [twin.answer for twin in twins]
        assert all(a is not None for a in answers), server.log_tail()
        n = prompt_tokens(answers[0])

        records = [r for r in _records(server) if r["prompt_tokens"] == n]
        assert len(records) == len(LIMITS), records  # one record per request, none collapsed
        assert len({r["request_id"] for r in records}) == len(LIMITS), records
        kept = sorted(r["reply_tokens"] for r in records)
        assert len(set(kept)) == len(LIMITS) and kept[0] > 0, kept  # each kept its own reply

        cold = _cold(server, messages, max(LIMITS))
        for answer in answers:  # admitted while another row decodes: no first-token top logprobs
            own = reply_tokens(answer)
            assert own == reply_tokens(cold)[:len(own)]

        for i, (twin, answer) in enumerate(zip(twins, answers)):  # each twin's own next turn
            follow_up = messages + [{"role": "assistant", "content": reply_text(answer)},
                                    {"role": "user", "content": text(30, 3510 + i)}]
            warm, line = server.chat_restore(follow_up, tenant=TENANT, max_tokens=4, logprobs=True, top_logprobs=5)
            # Past its own reply (the tiny model's template re-renders it verbatim): a shorter
            # twin's from the longest twin's entry, whose point there it kept.
            assert cached_tokens(warm) == fed_tokens(answer), (line, LIMITS[i])
            assert_same_output(warm, _cold(server, follow_up, 4))
