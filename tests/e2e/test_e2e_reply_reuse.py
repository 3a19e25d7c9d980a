"""End to end, real HTTP: warm turns of a conversation whose replies are re-sent prefill only what is new.

Issue 13: a request's entry moves past the reply it generated, so the next turn, whose prompt
re-renders that reply, restores past it. The tiny model makes this the real GLM-4.5 case: its
template re-renders a reply without reasoning verbatim (``apcctl bench templates``, row ``tiny``)
and its tokenizer gives the sampled ids back from the reply's text, so a client that re-sends
``content`` sends previous prompt + generated ids + the new user turn. What no cache could hold
is computed here from the tokenizer and template alone: the next prompt's tokens minus the
longest prefix it shares with the previous prompt + generated ids.

* per warm turn the server prefills at most 1.3x that, and every answer equals a cold server's
  (a fresh ``X-APC-Tenant`` is a cold namespace);
* a regenerate and an edited reply land on the prompt end (n - 1), which stays a checkpoint;
* with ``APC_LINEAGE_REPLY_REUSE=0`` the same conversation prefills the whole reply again.

Two servers (reply reuse on and off), started together, one per module.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.server_harness import (PatchedServer, assert_same_output, cached_tokens, prompt_tokens,
                            text)
from server_patch.lineage.lookup import common_prefix_len

TURNS = 4
MAX_TOKENS = 32
PARAMS = {"max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 5}
TARGET = 1.3  # prefilled / what no cache could hold, per warm turn (issue 13 §3)


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(reply reuse on, reply reuse off), started concurrently."""
    env = {"TOP_LOGPROBS_K": "5"}
    on = PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path_factory.mktemp("reuse-on"))
    off = PatchedServer(tiny_model_dir, env=env | {"APC_LINEAGE_REPLY_REUSE": "0"},
                        log_dir=tmp_path_factory.mktemp("reuse-off"))
    errors: list[BaseException] = []

    def start(server: PatchedServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in (on, off)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        if errors:
            raise errors[0]
        yield on, off
    finally:
        on.stop()
        off.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@dataclass
class Turn:
    """One request of a conversation: what was sent, what came back, and its ids."""

    messages: list[dict[str, Any]]
    answer: dict[str, Any]
    prompt: list[int]  # the prompt's ids, rendered and tokenized as the server does
    generated: list[int]  # the reply's ids, from its text (what a client can re-send)

    @property
    def reply(self) -> str:
        return self.answer["choices"][0]["message"]["content"]

    @property
    def prefilled(self) -> int:
        return prompt_tokens(self.answer) - cached_tokens(self.answer)


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The server's rendering: add_generation_prompt, thinking off (mlx-vlm's server default)."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def ask(server: PatchedServer, tokenizer: Any, messages: list[dict[str, Any]], tenant: str) -> Turn:
    answer = server.chat(messages, tenant=tenant, **PARAMS)
    ids = prompt_ids(tokenizer, messages)
    assert prompt_tokens(answer) == len(ids), "the test renders the prompt differently from the server"
    turn = Turn(list(messages), answer, ids, [])
    # The prompt closes the think block and the model never samples one: all of it is content.
    assert turn.reply and not answer["choices"][0]["message"].get("reasoning_content"), answer
    turn.generated = tokenizer.encode(turn.reply, add_special_tokens=False)
    if answer["choices"][0]["finish_reason"] == "length":  # every sampled id came back from the text
        assert len(turn.generated) == MAX_TOKENS == int(answer["usage"]["completion_tokens"])
    return turn


def follow_up(turn: Turn, question: str, reply: str | None = None) -> list[dict[str, Any]]:
    """The next request: the reply re-sent as ``content`` (or ``reply`` instead), a new question."""
    return turn.messages + [{"role": "assistant", "content": turn.reply if reply is None else reply},
                            {"role": "user", "content": question}]


def converse(server: PatchedServer, tokenizer: Any, tenant: str) -> list[Turn]:
    messages = [{"role": "system", "content": text(60, 1)}, {"role": "user", "content": text(14, 2)}]
    turns = [ask(server, tokenizer, messages, tenant)]
    for k in range(1, TURNS):
        turns.append(ask(server, tokenizer, follow_up(turns[-1], text(12, 10 + k)), tenant))
    return turns


def common_prefix(a: list[int], b: list[int]) -> int:
    return common_prefix_len(np.asarray(a), np.asarray(b))


def unavoidable(previous: Turn, turn: Turn) -> int:
    """Tokens of ``turn``'s prompt that no cache could hold: the new user text and template tokens."""
    return len(turn.prompt) - common_prefix(turn.prompt, previous.prompt + previous.generated)


@pytest.fixture(scope="module")
def conversation(servers, tokenizer) -> list[Turn]:
    return converse(servers[0], tokenizer, "reuse-on")


@pytest.mark.server
def test_warm_turns_prefill_only_what_is_new_and_answer_as_cold(servers, conversation) -> None:
    on, _ = servers
    assert cached_tokens(conversation[0].answer) == 0
    for previous, turn in zip(conversation, conversation[1:]):
        new = unavoidable(previous, turn)
        # The template re-renders the reply verbatim: all of it is shared, only the turn is new.
        assert len(turn.prompt) - new == len(previous.prompt) + len(previous.generated)
        assert new < len(previous.generated)  # so prefilling the reply again could not pass
        assert turn.prefilled <= TARGET * new, (turn.prefilled, new, cached_tokens(turn.answer))
        assert cached_tokens(turn.answer) > len(previous.prompt)  # restored past the previous prompt
    for k, turn in enumerate(conversation):
        cold = on.chat(turn.messages, tenant=f"reuse-cold-{k}", **PARAMS)
        assert cached_tokens(cold) == 0
        assert_same_output(turn.answer, cold)


@pytest.mark.server
def test_regenerate_and_edited_reply_restore_at_the_prompt_end(servers, tokenizer, conversation) -> None:
    on, _ = servers
    last = conversation[-1]
    # A regenerate: the same prompt again. The entry's head is past the reply; the prompt end
    # (n - 1) is still a checkpoint, and the reply comes out the same.
    again = ask(on, tokenizer, last.messages, "reuse-on")
    assert cached_tokens(again.answer) == len(last.prompt) - 1
    assert_same_output(again.answer, last.answer)

    # An edited reply: the next prompt shares the reply's first words only. A recurrent state
    # cannot be rewound to them, so the restore point is the prompt end again, never less.
    words = last.reply.split()
    edited = " ".join(words[:-3] + ["apple", "banana", "orange"])
    messages = follow_up(last, text(12, 40), reply=edited)
    turn = ask(on, tokenizer, messages, "reuse-on")
    shared = common_prefix(turn.prompt, last.prompt + last.generated)
    assert len(last.prompt) < shared < len(last.prompt) + len(last.generated)
    assert cached_tokens(turn.answer) == len(last.prompt) - 1
    assert_same_output(turn.answer, on.chat(messages, tenant="reuse-cold-edit", **PARAMS))


@pytest.mark.server
def test_without_reply_reuse_warm_turns_prefill_the_reply_again(servers, tokenizer, conversation) -> None:
    _, off = servers
    without = converse(off, tokenizer, "reuse-off")
    assert [t.reply for t in without] == [t.reply for t in conversation]  # the same conversation
    for previous, turn, reused in zip(without, without[1:], conversation[1:]):
        assert cached_tokens(turn.answer) == len(previous.prompt) - 1  # the prompt end, as before
        assert turn.prefilled >= reused.prefilled + len(previous.generated) - 1
        assert turn.prefilled > TARGET * unavoidable(previous, turn)
