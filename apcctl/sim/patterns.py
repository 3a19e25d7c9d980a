"""Agent request patterns real clients send, as replay requests: one conversation, step by step.

What real agent clients do after a request (aider, the ``openai`` client with streamed and
aborted turns, ``cache-pressure``'s agent and abort simulations), each a ``Step`` kind:

* ``turn``: the reply is kept and a new user message follows;
* ``abort_kept``: the stream was cut after ``cut`` reply tokens, the partial reply is kept;
* ``abort_dropped``: the stream was cut, the partial reply dropped: user after user;
* ``no_reply``: the reply was generated but not re-sent (a tool result sent straight after);
* ``edit``: the last user message rewritten, keeping its first ``keep`` tokens;
* ``regenerate``: the reply rejected, the same prompt sent again;
* ``subagent``: a sub-agent (same system text, its own tools) runs ``turns`` turns, then the
  parent goes on with its result as a user message.

A conversation with a ``reminder`` (aider's ~450-token system reminder) renders it after the
newest user message only, so each next prompt diverges right after the previous user text.
Every request carries the reply the model was fed (its partial reply when aborted) and the
template's segments; ``mark_verbatim`` says which replies later prompts repeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from apcctl.sim.trace import Request
from apcctl.sim.tracegen import ASSISTANT, USER, VOCAB, Conversation, Persona, mark_verbatim

GENERATION_TAIL = 16  # ids of the generation prompt's tokens after ASSISTANT ("assistant", "\n")
STEP_KINDS = ("turn", "abort_kept", "abort_dropped", "no_reply", "edit", "regenerate", "subagent")


@dataclass(frozen=True)
class Step:
    """How the pending request ended and what the client sends next (lengths in tokens)."""

    kind: str
    question: int = 20  # the new (or rewritten) user message
    reply: int = 100  # the reply generated for the pending request
    cut: int = 0  # abort_*: reply tokens streamed before the cancel
    keep: int = 0  # edit: tokens of the old message kept
    turns: int = 2  # subagent


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.out: list[Request] = []
        self.t = 0.0

    def tokens(self, count: int) -> np.ndarray:
        return self.rng.integers(*VOCAB, size=max(1, count), dtype=np.int32)

    def emit(self, conv: Conversation, kind: str) -> Request:
        self.t += 1.0
        conv.last = conv.request(self.t, kind)
        self.out.append(conv.last)
        return conv.last

    def generate(self, conv: Conversation, count: int) -> np.ndarray:
        """The pending request's reply: what the model was fed."""
        reply = self.tokens(count)
        assert conv.last is not None
        conv.last.reply = reply
        return reply


def build(steps: Sequence[Step], *, seed: int = 0, tools: int = 600, system: int = 400,
          first_question: int = 30, reminder: int = 0, sub_tools: int = 200,
          generation: int = 3, conv_id: str = "agent") -> list[Request]:
    """The requests one agent conversation sends for ``steps`` (in order, indexed).

    ``generation``: tokens of the generation prompt (3, as Qwen's; GLM's is 1)."""
    b = _Builder(seed)
    persona = Persona(conv_id, b.tokens(tools), b.tokens(system))
    sub_persona = Persona(f"{conv_id}-sub", b.tokens(sub_tools), persona.system)
    gen = (ASSISTANT, *(GENERATION_TAIL + i for i in range(max(0, generation - 1))))
    conv = Conversation(conv_id, conv_id, persona, generation=gen,
                        reminder=b.tokens(reminder) if reminder > 0 else None)
    conv.add(USER, b.tokens(first_question))
    b.emit(conv, "new_session")
    subagents = 0
    for step in steps:
        if step.kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {step.kind!r}; known: {', '.join(STEP_KINDS)}")
        if step.kind == "regenerate":
            b.generate(conv, step.reply)
            b.emit(conv, "regenerate")
            continue
        if step.kind == "edit":
            b.generate(conv, step.reply)
            old = conv.messages.pop()[1:]
            conv.add(USER, np.concatenate([old[: min(step.keep, len(old))], b.tokens(step.question)]))
            b.emit(conv, "edit")
            continue
        cut = max(1, min(step.cut, step.reply))
        reply = b.generate(conv, cut if step.kind.startswith("abort") else step.reply)
        if step.kind in ("turn", "abort_kept", "subagent"):
            conv.add(ASSISTANT, reply)
        if step.kind == "subagent":
            sub = Conversation(f"{conv_id}/sub{subagents}", f"{conv_id}-sub", sub_persona, generation=gen)
            subagents += 1
            for turn in range(max(1, step.turns)):
                sub.add(USER, b.tokens(step.question))
                b.emit(sub, "subagent" if turn == 0 else "turn")
                sub.add(ASSISTANT, b.generate(sub, step.reply))
        conv.add(USER, b.tokens(step.question))
        b.emit(conv, {"abort_dropped": "user_after_user", "no_reply": "user_after_user"}.get(
            step.kind, "turn"))
    b.generate(conv, 20)
    for i, req in enumerate(b.out):
        req.index = i
    mark_verbatim(b.out)
    return b.out


__all__ = ["STEP_KINDS", "Step", "build"]
