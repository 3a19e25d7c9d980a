"""Rows joining and leaving a decoding batch the copy-free way (``copyfree.batch``, issue 40), on
the real patched server: a long reply decodes while a conversation's restored next turn and a
new short request join its batch and leave it again, at different widths; every answer equals
the same request served cold and alone, and the decoding reply's record shows the joins and
leaves it went through. Answers and records, never a time.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.test_request_waits import records
from tests.server_harness import PatchedServer, assert_same_output, cached_tokens, reply_text, text, wait_for

LOGPROBS = {"logprobs": True, "top_logprobs": 5}


@pytest.mark.server
def test_rows_joining_and_leaving_a_decoding_batch_answer_as_cold(tiny_model_dir: Path, tmp_path: Path) -> None:
    with PatchedServer(tiny_model_dir, env={"TOP_LOGPROBS_K": "5"}, log_dir=tmp_path) as server:
        conversation = [{"role": "system", "content": text(30, 4101)}, {"role": "user", "content": text(600, 4102)}]
        first = server.chat(conversation, tenant="conv", max_tokens=8, **LOGPROBS)
        next_turn = [*conversation, {"role": "assistant", "content": reply_text(first)},
                     {"role": "user", "content": text(20, 4103)}]
        short = [{"role": "user", "content": text(60, 4104)}]
        long_reply = [{"role": "user", "content": text(40, 4105)}]

        with ThreadPoolExecutor(3) as pool:
            decoding = pool.submit(server.chat, long_reply, tenant="long", max_tokens=240, **LOGPROBS)
            wait_for(lambda: any(r.ttft_ms > 0 and not r.ended for r in records(server)), "a row decoding", server)
            warm = pool.submit(server.chat, next_turn, tenant="conv", max_tokens=24, **LOGPROBS)
            beside = pool.submit(server.chat, short, tenant="short", max_tokens=40, **LOGPROBS)
            answers = {"long": decoding.result(300), "warm": warm.result(300), "short": beside.result(300)}

        streaming = max(records(server), key=lambda r: r.reply_tokens)
        assert streaming.waited.get("join", 0) > 0 and streaming.waited.get("leave", 0) > 0, streaming
        warm_record = next(r for r in records(server) if r.prompt_tokens > 600 and r.restored_tokens > 0)
        assert warm_record.restored_tokens > 600  # the next turn joined restored, at its own width

        for name, messages, tokens in (("long", long_reply, 240), ("warm", next_turn, 24), ("short", short, 40)):
            cold = server.chat(messages, tenant=f"cold-{name}", max_tokens=tokens, **LOGPROBS)  # alone
            assert_same_output(answers[name], cold)


@pytest.mark.server
def test_a_long_row_that_stays_when_a_short_one_leaves_is_not_copied_and_its_next_turn_answers_as_cold(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The conversation's turn (600 tokens) decodes; a short request joins its batch and leaves
    it first. The long row stays in the joint buffer (``filter_kv`` keeps it in place: the copy
    counter sees no ``filter`` copy), its next tokens are written there in place (no copy-on-write),
    its reply is committed at its end (appended to its entry, or copied out of that buffer, never
    adopted with the short row's rows), and the conversation's next turn restores that entry and
    answers as the same turn served cold."""
    ledger = tmp_path / "copies.json"
    env = {"TOP_LOGPROBS_K": "5", "APC_COPY_COUNTER": "1", "APC_COPY_COUNTER_FILE": str(ledger)}
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path) as server:
        conversation = [{"role": "system", "content": text(30, 4201)}, {"role": "user", "content": text(600, 4202)}]
        short = [{"role": "user", "content": text(40, 4203)}]
        with ThreadPoolExecutor(2) as pool:
            decoding = pool.submit(server.chat, conversation, tenant="conv", max_tokens=60, **LOGPROBS)
            wait_for(lambda: any(r.ttft_ms > 0 and not r.ended for r in records(server)), "the long row decoding", server)
            beside = pool.submit(server.chat, short, tenant="short", max_tokens=4, **LOGPROBS)
            first, short_answer = decoding.result(300), beside.result(300)
        wait_for(lambda: len(records(server)) == 2 and all(r.ended for r in records(server)), "both rows ended", server)
        long_record = max(records(server), key=lambda r: r.prompt_tokens)
        assert long_record.waited.get("join", 0) > 0 and long_record.waited.get("leave", 0) > 0, long_record
        copies = json.loads(ledger.read_text())
        assert "filter.kv" not in copies, copies  # the leave moved no row of the long one
        assert "cow.kv" not in copies, copies  # and no write after it copied the buffer it was kept in

        next_turn = [*conversation, {"role": "assistant", "content": reply_text(first)},
                     {"role": "user", "content": text(20, 4204)}]
        warm = server.chat(next_turn, tenant="conv", max_tokens=8, **LOGPROBS)
        assert cached_tokens(warm) > 600  # past the first turn's prompt: its reply was kept
        for answer, messages, tokens, name in ((first, conversation, 60, "first"), (short_answer, short, 4, "short"),
                                               (warm, next_turn, 8, "warm")):
            assert_same_output(answer, server.chat(messages, tenant=f"cold-{name}", max_tokens=tokens, **LOGPROBS))


@pytest.mark.server
def test_a_second_short_request_joins_into_the_row_the_first_one_freed(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A long stream decodes alone; a short request joins its batch (the long row written once,
    into the joint buffer) and leaves (the long row kept in place); a second one joins into the
    row the first freed: the copy counter counts no second ``extend`` copy, and its answer equals
    the same request served alone."""
    from tests.integration.test_pacing import Stream, stop_streams

    ledger = tmp_path / "copies.json"
    env = {"APC_COPY_COUNTER": "1", "APC_COPY_COUNTER_FILE": str(ledger)}
    visits = [[{"role": "user", "content": text(30, seed)}] for seed in (4301, 4302)]
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path) as server:
        stream = Stream(server, max_tokens=2000)  # its greedy reply runs ~600 tokens
        stream.start()
        assert stream.decoding.wait(120)
        server.chat(visits[0], tenant="v0", max_tokens=4)
        wait_for(lambda: sum(r.ended for r in records(server)) == 1, "the first visitor's row left", server)
        extended = json.loads(ledger.read_text()).get("extend.kv")
        assert extended  # the first join wrote the long row into the joint buffer
        answer = server.chat(visits[1], tenant="v1", max_tokens=4)
        wait_for(lambda: sum(r.ended for r in records(server)) == 2, "the second visitor's row left", server)
        assert not stream.stopping.is_set() and stream.is_alive()  # the long stream decoded throughout
        assert json.loads(ledger.read_text()).get("extend.kv") == extended  # the second join moved no row
        stop_streams(server, stream)
        # The greedy reply (no logprobs: mlx-vlm reports none for a row joining a batch whose rows
        # asked for none, as the stream here).
        assert reply_text(answer) == reply_text(server.chat(visits[1], tenant="alone", max_tokens=4))
