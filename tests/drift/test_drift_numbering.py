"""Messages are numbered from the server's own finder (a real template and tokenizer, offline),
past the end of the prompt an earlier request sent whole: the finder renders no prefix there
(that request's entry sits a few tokens on), yet a message ends there."""

from __future__ import annotations

import random

import numpy as np
import pytest

from apcctl.lab.sim.tracegen_rendered import _Renderer
from apcctl.lab.tinymodel.agent_prompts import words
from server_patch.boundaries import Kind
from server_patch.drift import DriftDetector

SYSTEM = {"role": "system", "content": "You are the numbering test's assistant. " + words(random.Random(1), 40)}
U1, A1, U2, A2, U3 = ("Read the parser module and list what it exports, briefly.",
                      "It exports parse, tokenize and the Parser class; tokenize is used by the CLI only.",
                      "Now find the off by one error in the tokenizer loop and fix it.",
                      "Fixed: the loop stopped one token early; a test covers it now.",
                      "Thanks. Run the whole test suite.")


@pytest.fixture(params=["glm45.jinja", "qwen3.jinja"])
def lineage(request):
    """One renderer (finder) and detector; ``send(namespace, messages)`` renders, observes, and
    holds a reply after it, as the server does. qwen3 draws the last assistant message with
    ``<think>`` tags, so its prefix renders part inside that message."""
    renderer = _Renderer(request.param, system_points=True)
    detector = DriftDetector()
    reply = np.asarray(renderer.tokenizer.encode(A2, add_special_tokens=False), dtype=np.int32)

    def send(namespace: str, messages: list[dict[str, str]]) -> tuple[dict, dict]:
        tokens, info = renderer.request(messages, [])
        found = detector.observe(tokens, namespace, kinds=info.kinds,
                                 gen_start=renderer.finder.template.gen_start(tokens),
                                 decode=lambda ids: renderer.tokenizer.decode([int(i) for i in ids]))
        detector.observe_reply(np.concatenate([tokens, reply]), namespace, len(tokens))
        return found, dict(info.kinds)

    return send


def turns(*texts: str) -> list[dict[str, str]]:
    return [SYSTEM, *({"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts))]


def test_the_earlier_prompts_end_is_a_message_end_not_a_segment(lineage) -> None:
    lineage("ns", turns(U1))
    _, kinds = lineage("ns", turns(U1, A1, U2))
    assert list(kinds.values()).count(Kind.SENT) == 1  # where the first request's messages ended
    # the reply's end: a message end (glm45), or a label where qwen3's render of it rejoins
    assert list(kinds.values()).count(Kind.MESSAGE) + list(kinds.values()).count(Kind.REJOIN) >= 1


def test_an_edit_after_the_earlier_prompts_end_names_its_message(lineage) -> None:
    lineage("ns", turns(U1))
    lineage("ns", turns(U1, A1, U2))
    found, _ = lineage("ns", turns(U1, A1, U2.replace("find", "find and explain"), A2, U3))
    # not "message 3 (user)" (the earlier prompt's end uncounted), nor on qwen3 "message 4
    # (assistant)" (the reply's end unknown: its render has <think> tags, the prompt none)
    assert found["segment"] == "message 4 (user)", found


def test_an_edited_reply_in_the_history_names_its_message_and_role(lineage) -> None:
    lineage("ns", turns(U1))
    lineage("ns", turns(U1, A1, U2))
    found, _ = lineage("ns", turns(U1, A1.replace("the CLI", "the command line"), U2, A2, U3))
    assert found["segment"] == "message 3 (assistant)", found  # not "message 2 (user)"

