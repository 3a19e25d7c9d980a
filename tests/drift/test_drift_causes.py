"""Each cause of client drift, named from token ids and a decoder (``server_patch.drift``)."""

from __future__ import annotations

import numpy as np
import pytest

from server_patch.drift import Cause, DriftDetector, DriftSettings, RecentPrompts
from tests.drift.chat import WordTokenizer, render

SYSTEM = ("You are a careful coding agent. Follow the rules of the repository, run the tests before "
          "you answer, and keep every change small and reviewed.")
TASK = "Fix the failing test in the parser module and explain what was wrong with the tokenizer."
REPLY = "I looked at the parser and found the off by one error in the tokenizer loop, now fixed."


def conversation(*turns: str, system: str = SYSTEM) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return msgs


@pytest.fixture
def tok() -> WordTokenizer:
    return WordTokenizer()


def detect(tok: WordTokenizer, earlier, later, *, tools_a=None, tools_b=None, reply: str | None = None,
           namespace_b: str = "ns") -> dict:
    """``earlier`` then ``later`` (message lists) through one detector; ``reply``: the text
    generated after ``earlier`` (held with it, as reply reuse does)."""
    detector = DriftDetector(DriftSettings())
    ids, kinds, gen = render(tok, earlier, tools_a)
    assert detector.observe(ids, "ns", kinds=kinds, gen_start=gen, decode=tok.decode) == {}
    if reply is not None:
        detector.observe_reply(np.concatenate([ids, tok.encode(reply)]), "ns", len(ids))
    ids, kinds, gen = render(tok, later, tools_b)
    return detector.observe(ids, namespace_b, kinds=kinds, gen_start=gen, decode=tok.decode)


def test_a_date_changed_in_the_system_prompt(tok):
    found = detect(tok, conversation(TASK, system=SYSTEM + " Today is Friday 2026-12-05, 17:15 UTC."),
                   conversation(TASK, REPLY, "Now add a test.",
                                system=SYSTEM + " Today is Saturday 2026-12-06, 09:02 UTC."))
    assert found["cause"] == Cause.DATE and found["segment"] == "system"
    assert "Friday" in found["removed"] and "Saturday" in found["added"]
    assert found["position"] > 0 and found["tokens"] > 0


def test_a_reminder_block_moved_to_the_end(tok):
    reminder = "<reminder>Keep answers short and run the linter before you commit anything.</reminder> "
    found = detect(tok, conversation(reminder + TASK, REPLY, "Now add a test."),
                   conversation(TASK, REPLY, "Now add a test. " + reminder))
    assert found["cause"] == Cause.MOVED and found["segment"] == "message 2 (user)"
    assert "reminder" in found["removed"] and found["added"] == ""


def test_a_block_removed_from_the_last_message(tok):
    note = " <note>The previous build log is attached below for your reference only.</note>"
    found = detect(tok, conversation(TASK, REPLY, "Now add a test." + note),
                   conversation(TASK, REPLY, "Now add a test.", "Done.", "Thanks, ship it."))
    assert found["cause"] == Cause.REMOVED and found["segment"] == "message 4 (user)"


def test_tools_re_ordered(tok):
    tools = ['{"name": "read_file", "description": "Read a file from the workspace"}',
             '{"name": "run_shell", "description": "Run a shell command in the workspace"}',
             '{"name": "edit_file", "description": "Replace text in a file of the workspace"}']
    found = detect(tok, conversation(TASK), conversation(TASK, REPLY, "More."),
                   tools_a=tools, tools_b=[tools[2], tools[0], tools[1]])
    assert found["cause"] == Cause.TOOLS and found["segment"] == "tools"


@pytest.mark.parametrize("generated, rendered, cause", [
    ("<think>The loop bound is wrong, check the index.</think>" + REPLY + "<|im_end|>", REPLY,
     Cause.REPLY_THINKING),
    (REPLY.replace(" now", "\n\nnow") + "<|im_end|>", REPLY, Cause.REPLY_WHITESPACE),
    (REPLY + "<|endoftext|>", REPLY, Cause.REPLY_STOP),
    ("A different answer altogether, written by the model first." + "<|im_end|>", REPLY, Cause.REPLY_OTHER),
])
def test_a_reply_re_rendered(tok, generated, rendered, cause):
    found = detect(tok, conversation(TASK), conversation(TASK, rendered, "Now add a test."), reply=generated)
    assert found["cause"] == cause and found["segment"] == "reply"


def test_a_system_prompt_edit(tok):
    found = detect(tok, conversation(TASK),
                   conversation(TASK, REPLY, "More.", system=SYSTEM.replace("small and reviewed",
                                                                            "tiny, typed and documented")))
    assert found["cause"] == Cause.SYSTEM and found["segment"] == "system"
    assert "reviewed" in found["removed"] and "documented" in found["added"]


def test_history_rebuilt_on_resume(tok):
    """qwen-code ``-c``: the first user message comes back without its date reminder."""
    reminder = "<system-reminder>This is the current date: 2026-12-05. Use it when asked.</system-reminder>\n"
    found = detect(tok, conversation(reminder + TASK, REPLY, "Now add a test."),
                   conversation(TASK, REPLY, "Now add a test.", "Added.", "Run it."))
    assert found["cause"] == Cause.RESUME and found["segment"] == "message 2 (user)"
    assert "current date" in found["removed"]


def test_a_retry_that_drops_the_reply(tok):
    """mini-swe-agent after a format error: the reply is dropped, a user message appended."""
    retry = conversation(TASK) + [{"role": "user", "content": "Your last output had a format error. Retry."}]
    found = detect(tok, conversation(TASK), retry)
    assert found["cause"] == Cause.RETRY and found["segment"] == "generation prompt"
    assert 0 < found["tokens"] < len(tok.encode("<|im_start|>assistant\n"))  # its shared "<|im_start|>" not


def test_another_conversation_is_not_drift(tok):
    assert detect(tok, conversation(TASK), conversation("Write a haiku about the sea, in French please.",
                                                        "Voici.", "Another one.")) == {}


def test_an_extension_is_not_drift(tok):
    assert detect(tok, conversation(TASK), conversation(TASK, REPLY, "Now add a test.")) == {}


def test_never_across_namespaces(tok):
    found = detect(tok, conversation(TASK, system=SYSTEM + " Today is 2026-12-05."),
                   conversation(TASK, REPLY, "More.", system=SYSTEM + " Today is 2026-12-06."), namespace_b="other")
    assert found == {}


def test_text_off_keeps_the_cause_and_position(tok):
    detector = DriftDetector(DriftSettings(text=False))
    for day in ("05", "06"):
        ids, kinds, gen = render(tok, conversation(TASK, system=SYSTEM + f" Today is 2026-12-{day}."))
        found = detector.observe(ids, "ns", kinds=kinds, gen_start=gen, decode=tok.decode)
    assert found["cause"] == Cause.DATE and found["position"] > 0
    assert not {"removed", "added", "context"} & set(found)


def test_without_a_decoder_token_causes_still_named(tok):
    detector = DriftDetector()
    ids, kinds, gen = render(tok, conversation(TASK))
    detector.observe(ids, "ns", kinds=kinds, gen_start=gen)
    ids, kinds, gen = render(tok, conversation(TASK) + [{"role": "user", "content": "Format error, retry."}])
    assert detector.observe(ids, "ns", kinds=kinds, gen_start=gen)["cause"] == Cause.RETRY


def test_the_ring_is_bounded(tok):
    ring = RecentPrompts(per_namespace=2, namespaces=2, max_tokens=10_000)
    for n in range(5):
        ring.add(np.arange(n * 100, n * 100 + 50), f"ns{n % 3}")
    assert ring.tokens <= 2 * 2 * 50
    assert ring.nearest(np.arange(0, 50), "ns0")[1] == 0  # ns0 was the least recently seen: dropped
    seen, shared = ring.nearest(np.arange(400, 460), "ns1")
    assert shared == 50 and seen.length == 50


def test_a_prompt_and_its_reply_replace_the_prompt(tok):
    ring = RecentPrompts()
    prompt = np.arange(40)
    ring.add(prompt, "ns", gen_start=36)
    held = ring.add(np.arange(60), "ns", reply_from=40)
    assert held.gen_start == 36 and ring.tokens == 60
