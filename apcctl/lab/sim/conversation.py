"""The conversations a replay trace is made of: a GLM-like template's tokens, a persona's
system prompt and tools, and a conversation that renders the prompt a client would send.

Both the trace generator's own actors (``tracegen``) and the real clients' patterns
(``patterns``) build on these; they lived in ``tracegen``, which also runs the patterns, so the
two imported each other (issue 35).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import numpy as np

from apcctl.lab.sim.trace import Request

# Template tokens (GLM-like): [gMASK]<sop><|system|>tools<|system|>system<|user|>...<|assistant|>
GMASK, SOP, SYSTEM, USER, ASSISTANT, TIMESTAMP = 10, 11, 12, 13, 14, 15
VOCAB = (1000, 150_000)
ANCHOR_SLACK = 2  # the server anchors 2 tokens short of the rendered prefix (BPE merges)
CLOCK_BASE = dt.datetime(2026, 11, 30, 9, 0)


@dataclass(frozen=True)
class Persona:
    """A system prompt and tool list; ``timestamp_at`` is where a per-minute clock is rendered."""

    name: str
    tools: np.ndarray
    system: np.ndarray
    timestamp_at: int | None = None

    def prefix(self, minute: int) -> tuple[np.ndarray, int]:
        """The rendered system+tools prefix at ``minute`` and the tools-block end."""
        system = self.system
        if self.timestamp_at is not None:
            system = system.copy()
            stamp = timestamp_tokens(minute)
            system[self.timestamp_at:self.timestamp_at + len(stamp)] = stamp
        head = np.asarray([GMASK, SOP, SYSTEM], dtype=np.int32)
        tools_end = len(head) + len(self.tools)
        return np.concatenate([head, self.tools, [SYSTEM], system]).astype(np.int32), tools_end


def timestamp_tokens(minute: int) -> np.ndarray:
    """'2026-11-30 09:41' as tokens: the minute token changes every minute."""
    when = CLOCK_BASE + dt.timedelta(minutes=minute)
    return np.asarray([TIMESTAMP, 2000 + when.month * 40 + when.day, 3000 + when.hour,
                       4000 + when.minute], dtype=np.int32)


@dataclass
class Conversation:
    """Messages so far (role token + content each); renders the prompt a client would send."""

    id: str
    agent: str
    persona: Persona
    messages: list[np.ndarray] = field(default_factory=list)
    last: Request | None = None  # the latest request sent, which the next reply answers
    # The generation prompt; an assistant message renders it before its content. GLM's is one
    # token, Qwen's ("<|im_start|>assistant\n") three: then a prompt that ends at the last
    # message, not at the generation prompt, shares less than the entry at n - 1.
    generation: tuple[int, ...] = (ASSISTANT,)
    # Rendered after the newest user message only (aider's moving system reminder).
    reminder: np.ndarray | None = None
    # Boundaries inside its messages the server's finder offers (a reminder block's start).
    inner: tuple[int, ...] = ()

    def add(self, role: int, content: np.ndarray) -> None:
        head = self.generation if role == ASSISTANT else (role,)
        self.messages.append(np.concatenate([head, content]).astype(np.int32))

    def request(self, t: float, kind: str) -> Request:
        prefix, tools_end = self.persona.prefix(int(t // 60))
        messages = list(self.messages)
        if self.reminder is not None and messages and messages[-1][0] == USER:
            messages[-1] = np.concatenate([messages[-1], self.reminder]).astype(np.int32)
        starts, pos = [], len(prefix)
        for message in messages:
            starts.append(pos)
            pos += len(message)
        tokens = np.concatenate([prefix, *messages, self.generation]).astype(np.int32)
        return Request(conv=self.id, t=round(t, 3), tokens=tokens,
                       anchor_len=len(prefix) - ANCHOR_SLACK,
                       segments=(tools_end, len(prefix), *starts), kind=kind, agent=self.agent,
                       gen=len(self.generation), blocks=self.inner)


def mark_verbatim(requests: list[Request]) -> None:
    """A reply is verbatim when a later prompt of its conversation starts with prompt + reply."""
    later: dict[str, list[Request]] = {}
    for req in reversed(requests):
        if req.reply is not None:
            seen = req.seen
            req.reply_verbatim = any(
                other.n >= seen.shape[0] and np.array_equal(other.tokens[:seen.shape[0]], seen)
                for other in later.get(req.conv, ()))
        later.setdefault(req.conv, []).append(req)
