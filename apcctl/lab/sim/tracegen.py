"""Deterministic agent traffic for the replay: the shapes the post's log showed, by seed.

Six actors run side by side, each from its own random stream (so one actor's choices never
shift another's): these three, and three real clients' patterns (``apcctl.lab.sim.patterns``: aider's
moving reminder, a streaming client's aborted and interrupted turns, qwen-code resuming a
session with its first user message rebuilt and dropping a reply after a format error):

* ``carmen``: an assistant (9-12k-token tools + system prompt) in multi-turn sessions with
  7-50-token questions and realistic replies; new sessions reuse the same system prompt. Its
  first session carries one of each resend: a retry after a dropped stream and a regenerate
  (both identical resends) and an edited last message; later sessions draw them at random.
* ``coder``: a coding tool, two system-prompt variants that differ by 4 tokens near the end of
  the system text; every few turns it spawns 2-3 parallel sub-agents, which share its system
  text but not its tools (so, with tools rendered first, not its prefix either).
* ``carmen-sched``: a scheduled agent on Carmen's tools whose system text carries a timestamp
  re-rendered on every request, so it changes every minute.

Prompts are rendered the way GLM's template lays them out: tools block first, then the system
text, then the messages, then the generation prompt. Every next turn re-sends the whole
conversation, the previous reply included. Each request carries the reply generated for it
(``reply``; none for a stream dropped before a retry or a question edited before its answer) and
whether the conversation's next prompt repeats it verbatim: it does whenever the reply is kept,
as GLM-4.5/4.6/4.7's templates re-render a reply without reasoning (``apcctl bench templates``);
a rejected regenerate's reply is not. ``--scale tiny`` keeps the shapes and divides the lengths
by ~20.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from apcctl.lab.sim.conversation import ANCHOR_SLACK, ASSISTANT, USER, VOCAB, Conversation, Persona, mark_verbatim
from apcctl.lab.sim.patterns import abort_sessions, aider_sessions, resume_sessions
from apcctl.lab.sim.trace import Request

VARIANT_TOKENS = 4
DECODE_TOKENS_PER_S = 30.0


@dataclass(frozen=True)
class Scale:
    """Lengths in full-scale tokens are multiplied by ``factor``; questions have their own range."""

    name: str
    factor: float
    question: tuple[int, int]

    def n(self, full_tokens: float) -> int:
        return max(1, int(round(full_tokens * self.factor)))


SCALES = {"full": Scale("full", 1.0, (7, 50)), "tiny": Scale("tiny", 1 / 20, (3, 8))}


class _Actor:
    """One source of traffic with its own random stream."""

    def __init__(self, seed: int, stream: int, scale: Scale, horizon: float) -> None:
        self.rng = np.random.default_rng([seed, stream])
        self.scale = scale
        self.horizon = horizon
        self.out: list[Request] = []

    def tokens(self, count: int) -> np.ndarray:
        return self.rng.integers(*VOCAB, size=count, dtype=np.int32)

    def question(self) -> np.ndarray:
        low, high = self.scale.question
        return self.tokens(int(self.rng.integers(low, high + 1)))

    def reply(self, median: float) -> np.ndarray:
        """Lognormal reply length around ``median`` full-scale tokens, clipped to 30-2500."""
        full = float(np.clip(self.rng.lognormal(np.log(median), 0.7), 30, 2500))
        return self.tokens(self.scale.n(full))

    def pause(self, low: float, high: float) -> float:
        return float(self.rng.uniform(low, high))

    def emit(self, conv: Conversation, t: float, kind: str) -> None:
        conv.last = conv.request(t, kind)
        self.out.append(conv.last)

    def answer(self, conv: Conversation, t: float, median: float) -> float:
        """Generate a reply into the conversation; returns when it finished streaming."""
        reply = self.reply(median)
        conv.add(ASSISTANT, reply)
        if conv.last is not None:
            conv.last.reply = reply
        return t + len(reply) / (DECODE_TOKENS_PER_S * self.scale.factor)


def make_personas(seed: int, scale: Scale) -> dict[str, Persona]:
    rng = np.random.default_rng([seed, 0])

    def draw(low: float, high: float) -> np.ndarray:
        return rng.integers(*VOCAB, size=scale.n(rng.uniform(low, high)), dtype=np.int32)

    carmen_tools, code_tools, sub_tools = draw(7000, 8500), draw(7000, 8000), draw(1200, 2000)
    carmen_system, code_system, sched_system = draw(2000, 3000), draw(2500, 3500), draw(2000, 2800)
    variant = code_system.copy()
    at = len(variant) - max(6, scale.n(30)) - VARIANT_TOKENS
    variant[at:at + VARIANT_TOKENS] = rng.integers(*VOCAB, size=VARIANT_TOKENS, dtype=np.int32)
    return {
        "carmen": Persona("carmen", carmen_tools, carmen_system),
        "carmen-sched": Persona("carmen-sched", carmen_tools, sched_system,
                                timestamp_at=min(scale.n(60), len(sched_system) - 4)),
        "coder-a": Persona("coder-a", code_tools, code_system),
        "coder-b": Persona("coder-b", code_tools, variant),
        "coder-sub": Persona("coder-sub", sub_tools, code_system),
    }


class _Carmen(_Actor):
    """Interactive sessions; the first one forces a retry, a regenerate and an edit."""

    FORCED = {1: "retry", 2: "regenerate", 3: "edit"}

    def run(self, persona: Persona) -> None:
        t, session = self.pause(0, 20), 0
        while t < self.horizon:
            conv = Conversation(f"carmen/s{session}", "carmen", persona)
            for turn in range(int(self.rng.integers(4, 11))):
                if t >= self.horizon:
                    break
                conv.add(USER, self.question())
                self.emit(conv, t, "new_session" if turn == 0 else "turn")
                t = self._resend(conv, t, self.FORCED.get(turn) if session == 0 else self._draw())
                t = self.answer(conv, t + 1.0, median=300) + self.pause(25, 90)
            t += self.pause(60, 240)
            session += 1

    def _draw(self) -> str | None:
        roll = self.rng.uniform()
        return "edit" if roll < 0.06 else "regenerate" if roll < 0.11 else "retry" if roll < 0.15 else None

    def _resend(self, conv: Conversation, t: float, event: str | None) -> float:
        if event == "retry":  # the stream dropped; the client sends the same prompt again
            t += self.pause(2, 8)
        elif event == "regenerate":  # a reply was produced and rejected; same prompt again
            t = self.answer(conv, t + 1.0, median=300) + self.pause(5, 20)
            conv.messages.pop()
        elif event == "edit":  # the last question rewritten, keeping its first few words
            t += self.pause(15, 45)
            last = conv.messages.pop()[1:]
            keep = int(self.rng.integers(0, max(1, len(last) // 2)))
            conv.add(USER, np.concatenate([last[:keep], self.question()]).astype(np.int32))
        else:
            return t
        self.emit(conv, t, event)
        return t


class _Coder(_Actor):
    """Long agent loops; variant B from the second session on every other one; sub-agents."""

    def run(self, personas: dict[str, Persona]) -> None:
        t, session, spawned = self.pause(5, 30), 0, 0
        while t < self.horizon:
            persona = personas["coder-b" if session % 2 == 1 else "coder-a"]
            conv = Conversation(f"coder/s{session}", "coder", persona)
            started, next_spawn = t, int(self.rng.integers(5, 9))
            for turn in range(int(self.rng.integers(15, 36))):
                if t >= self.horizon or t - started > 0.4 * self.horizon:
                    break
                conv.add(USER, self.question())
                self.emit(conv, t, "new_session" if turn == 0 else "turn")
                t = self.answer(conv, t + 1.0, median=450) + self.pause(4, 20)
                if turn == next_spawn:
                    t, spawned = self._spawn(personas["coder-sub"], conv, t, spawned)
                    next_spawn += int(self.rng.integers(7, 12))
            t += self.pause(30, 120)
            session += 1

    def _spawn(self, persona: Persona, parent: Conversation, t: float, spawned: int) -> tuple[float, int]:
        """2-3 sub-agents start together; the parent resumes with their results."""
        done = t
        for k in range(int(self.rng.integers(2, 4))):
            conv = Conversation(f"coder-sub/{spawned}", "coder-sub", persona)
            spawned += 1
            s = t + 0.5 * k
            for turn in range(int(self.rng.integers(3, 7))):
                conv.add(USER, self.question())
                self.emit(conv, s, "subagent" if turn == 0 else "turn")
                s = self.answer(conv, s + 1.0, median=250) + self.pause(3, 10)
            done = max(done, s)
        parent.add(USER, self.tokens(self.scale.n(self.rng.uniform(150, 400))))
        return done, spawned


class _Scheduled(_Actor):
    """A short session every 3-5 minutes; the prompt's clock is rendered per request."""

    def run(self, persona: Persona) -> None:
        start, session = self.pause(60, 120), 0
        while start < self.horizon:
            conv, t = Conversation(f"carmen-sched/s{session}", "carmen-sched", persona), start
            for turn in range(int(self.rng.integers(1, 4))):
                conv.add(USER, self.question())
                self.emit(conv, t, "scheduled" if turn == 0 else "turn")
                t = self.answer(conv, t + 1.0, median=200) + self.pause(10, 40)
            start += self.pause(180, 300)
            session += 1


def generate(seed: int = 7, scale: str = "full", minutes: float = 30.0) -> tuple[list[Request], dict[str, Any]]:
    """Requests in time order (ties: carmen, coder, scheduled, aider, streamer, resumer) and the trace
    header's metadata."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; known: {', '.join(SCALES)}")
    sc, horizon = SCALES[scale], minutes * 60.0
    personas = make_personas(seed, sc)
    carmen, coder, sched = (_Carmen(seed, 1, sc, horizon), _Coder(seed, 2, sc, horizon),
                            _Scheduled(seed, 3, sc, horizon))
    carmen.run(personas["carmen"])
    coder.run(personas)
    sched.run(personas["carmen-sched"])
    clients = aider_sessions(seed, sc, horizon) + abort_sessions(seed, sc, horizon) + resume_sessions(seed, sc, horizon)
    requests = sorted(carmen.out + coder.out + sched.out + clients, key=lambda r: r.t)
    for i, req in enumerate(requests):
        req.index = i
    mark_verbatim(requests)
    meta = {
        "generator": "apcctl.lab.sim.tracegen", "seed": seed, "scale": scale, "minutes": minutes,
        "anchor_slack": ANCHOR_SLACK,
        "personas": {name: {"tools": len(p.tools), "system": len(p.system)} for name, p in personas.items()},
    }
    return requests, meta
