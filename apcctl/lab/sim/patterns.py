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
  parent goes on with its result as a user message;
* ``resume``: the client restarts and resumes the session (qwen-code ``-c``): its history is
  rebuilt with the first user message's trailing reminder block (``first_reminder`` tokens,
  the current date) left out, then a new user message follows.

A conversation with a ``reminder`` (aider's ~450-token system reminder) renders it after the
newest user message only, so each next prompt diverges right after the previous user text.
Every request carries the reply the model was fed (its partial reply when aborted) and the
template's segments; ``mark_verbatim`` says which replies later prompts repeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from apcctl.lab.sim.conversation import ASSISTANT, USER, VOCAB, Conversation, Persona, mark_verbatim
from apcctl.lab.sim.trace import Request

GENERATION_TAIL = 16  # ids of the generation prompt's tokens after ASSISTANT ("assistant", "\n")
STEP_KINDS = ("turn", "abort_kept", "abort_dropped", "no_reply", "edit", "regenerate", "subagent", "resume")


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
    def __init__(self, seed: int | Sequence[int], t0: float, step_s: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.out: list[Request] = []
        self.t = t0
        self.step_s = step_s

    def tokens(self, count: int) -> np.ndarray:
        return self.rng.integers(*VOCAB, size=max(1, count), dtype=np.int32)

    def emit(self, conv: Conversation, kind: str) -> Request:
        self.t += self.step_s
        conv.last = conv.request(self.t, kind)
        self.out.append(conv.last)
        return conv.last

    def generate(self, conv: Conversation, count: int) -> np.ndarray:
        """The pending request's reply: what the model was fed."""
        reply = self.tokens(count)
        assert conv.last is not None
        conv.last.reply = reply
        return reply


def build(steps: Sequence[Step], *, seed: int | Sequence[int] = 0, tools: int = 600, system: int = 400,
          first_question: int = 30, reminder: int = 0, sub_tools: int = 200,
          generation: int = 3, conv_id: str = "agent", agent: str = "",
          persona: Persona | None = None, t0: float = 0.0, step_s: float = 1.0,
          first: np.ndarray | None = None, first_reminder: int = 0) -> list[Request]:
    """The requests one agent conversation sends for ``steps`` (in order, indexed; times from
    ``t0`` every ``step_s`` seconds).

    ``generation``: tokens of the generation prompt (3, as Qwen's; GLM's is 1); ``persona``:
    the system prompt and tools (default: drawn, ``tools`` + ``system`` tokens); ``first``: the
    first user message (default: ``first_question`` drawn tokens), followed by a reminder block
    of ``first_reminder`` drawn tokens that a ``resume`` leaves out."""
    b = _Builder(seed, t0, step_s)
    agent = agent or conv_id
    persona = persona or Persona(conv_id, b.tokens(tools), b.tokens(system))
    sub_persona = Persona(f"{agent}-sub", b.tokens(sub_tools), persona.system)
    gen = (ASSISTANT, *(GENERATION_TAIL + i for i in range(max(0, generation - 1))))
    conv = Conversation(conv_id, agent, persona, generation=gen,
                        reminder=b.tokens(reminder) if reminder > 0 else None)
    opening = b.tokens(first_question) if first is None else np.asarray(first, dtype=np.int32)
    reminder_block = b.tokens(first_reminder) if first_reminder > 0 else np.zeros(0, np.int32)
    conv.add(USER, np.concatenate([opening, reminder_block]).astype(np.int32))
    # Where the reminder block starts: the server's finder offers it (a section line inside the
    # first user message, ``boundaries.system_points``) while the message still holds it.
    reminder_at = len(persona.prefix(0)[0]) + 1 + len(opening) if first_reminder > 0 else 0
    conv.inner = (reminder_at,) if reminder_at else ()
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
        if step.kind == "resume":
            conv.add(ASSISTANT, b.generate(conv, step.reply))
            first_message, k = conv.messages[0], len(reminder_block)
            if k and len(first_message) > k and np.array_equal(first_message[-k:], reminder_block):
                conv.messages[0] = first_message[:-k]  # rebuilt without its reminder block
            conv.inner = ()
            conv.add(USER, b.tokens(step.question))
            b.emit(conv, "resume")
            continue
        cut = max(1, min(step.cut, step.reply))
        reply = b.generate(conv, cut if step.kind.startswith("abort") else step.reply)
        if step.kind in ("turn", "abort_kept", "subagent"):
            conv.add(ASSISTANT, reply)
        if step.kind == "subagent":
            sub = Conversation(f"{conv_id}/sub{subagents}", f"{agent}-sub", sub_persona, generation=gen)
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


# ----------------------------------------------------------------------------- in the replay trace

CLIENT_AGENTS = ("aider", "streamer", "resumer")  # the trace's agents whose requests these actors make
# What follows a request in the abort actor's sessions (the rest are plain turns).
_OUTCOMES = (("abort_kept", 0.08), ("abort_dropped", 0.08), ("no_reply", 0.06), ("edit", 0.04),
             ("regenerate", 0.04))


def _lognormal(rng: np.random.Generator, median: float, low: float, high: float) -> float:
    return float(np.clip(rng.lognormal(np.log(median), 0.7), low, high))


def aider_sessions(seed: int, scale: Any, horizon: float, sessions: int = 2) -> list[Request]:
    """aider in its default mode (``apcctl bench trace-gen``'s fourth actor): a 3-4k-token
    system prompt and repo map, 22-107-token questions, replies around 300 tokens, and the
    ~450-token reminder after the newest user message (GLM's one-token generation prompt)."""
    rng = np.random.default_rng([seed, 4])
    persona = Persona("aider", np.zeros(0, np.int32), rng.integers(*VOCAB, size=scale.n(rng.uniform(3000, 4000)),
                                                                     dtype=np.int32))
    out, t, session = [], float(rng.uniform(30, 90)), 0
    while t < horizon and session < sessions:
        steps = [Step("turn", question=scale.n(rng.uniform(22, 107)), reply=scale.n(_lognormal(rng, 300, 30, 1500)))
                 for _ in range(int(rng.integers(6, 16)))]
        got = build(steps, seed=[seed, 4, session], persona=persona, reminder=scale.n(450), generation=1,
                    first_question=scale.n(rng.uniform(22, 107)), conv_id=f"aider/s{session}", agent="aider",
                    t0=t, step_s=float(rng.uniform(20, 60)))
        out += [r for r in got if r.t < horizon]
        t = got[-1].t + float(rng.uniform(120, 300))
        session += 1
    return out


def abort_sessions(seed: int, scale: Any, horizon: float, sessions: int = 3) -> list[Request]:
    """A streaming agent client (the fifth actor): turns whose replies it sometimes aborts
    (the partial reply kept, or dropped and a new user message sent straight after), tool
    results sent without the reply, edits, regenerates, and now and then a 4-6k-token user
    turn (a pasted file); a three-token generation prompt (Qwen's), so that a prompt ending
    at the last message shares less than the entry at n - 1."""
    rng = np.random.default_rng([seed, 5])
    tools = rng.integers(*VOCAB, size=scale.n(rng.uniform(1500, 2500)), dtype=np.int32)
    persona = Persona("streamer", tools, rng.integers(*VOCAB, size=scale.n(rng.uniform(800, 1500)), dtype=np.int32))
    kinds, weights = [k for k, _ in _OUTCOMES] + ["turn"], [w for _, w in _OUTCOMES]
    weights.append(1.0 - sum(weights))
    out, t, session = [], float(rng.uniform(10, 60)), 0
    while t < horizon and session < sessions:
        steps = []
        for _ in range(int(rng.integers(5, 12))):
            kind = str(rng.choice(kinds, p=weights))
            long_turn = rng.uniform() < 0.15
            question = scale.n(rng.uniform(4000, 6000) if long_turn else rng.uniform(10, 120))
            reply = scale.n(_lognormal(rng, 400, 30, 2000))
            steps.append(Step(kind, question=question, reply=reply, cut=int(rng.integers(1, max(2, reply))),
                              keep=int(rng.integers(0, max(1, question)))))
        got = build(steps, seed=[seed, 5, session], persona=persona, generation=3, conv_id=f"streamer/s{session}",
                    agent="streamer", first_question=scale.n(rng.uniform(10, 120)), t0=t,
                    step_s=float(rng.uniform(10, 40)))
        out += [r for r in got if r.t < horizon]
        t = got[-1].t + float(rng.uniform(60, 240))
        session += 1
    return out


def resume_sessions(seed: int, scale: Any, horizon: float, sessions: int = 3) -> list[Request]:
    """qwen-code in one project (the sixth actor): each session's first user message is the
    project's context (2-3k tokens, the same every session) and a ~60-token date reminder; the
    second user message is the task; midway the client restarts with ``-c`` and rebuilds that
    first message without the reminder. Its mini-swe-agent-like sub-steps drop a reply after a
    format error and append a user message (``no_reply``: the next prompt parts at the previous
    one's generation prompt, three tokens as Qwen's)."""
    rng = np.random.default_rng([seed, 6])
    persona = Persona("resumer", rng.integers(*VOCAB, size=scale.n(rng.uniform(1500, 2500)), dtype=np.int32),
                      rng.integers(*VOCAB, size=scale.n(rng.uniform(1000, 2000)), dtype=np.int32))
    context = rng.integers(*VOCAB, size=scale.n(rng.uniform(2000, 3000)), dtype=np.int32)
    out, t, session = [], float(rng.uniform(20, 80)), 0
    while t < horizon and session < sessions:
        steps = []
        for turn in range(int(rng.integers(6, 10))):
            kind = "resume" if turn == 3 else ("no_reply" if rng.uniform() < 0.2 else "turn")
            steps.append(Step(kind, question=scale.n(rng.uniform(20, 200)), reply=scale.n(_lognormal(rng, 300, 30, 1500))))
        got = build(steps, seed=[seed, 6, session], persona=persona, generation=3, conv_id=f"resumer/s{session}",
                    agent="resumer", first=context, first_reminder=scale.n(60), t0=t,
                    step_s=float(rng.uniform(15, 45)))
        out += [r for r in got if r.t < horizon]
        t = got[-1].t + float(rng.uniform(60, 180))
        session += 1
    return out


__all__ = ["CLIENT_AGENTS", "STEP_KINDS", "Step", "abort_sessions", "aider_sessions", "build", "resume_sessions"]
