"""A trace of first-sight divergences: agent prompts that part from everything stored mid-prompt.

``apcctl.lab.sim.tracegen`` has one of each; this trace is made of them. Every actor has its own
random stream (one actor's choices never shift another's). Prompts are laid out as mlx-vlm
0.7.10 renders them on GLM's template: ``[gMASK]<sop><|system|>`` tools ``<|system|>`` system
text, then one role token + content per message, then ``<|assistant|>``. mlx-vlm joins every
system message of a request into one, with "\n\n" (a paragraph token here) between them.

* ``ops``: 12 tools (~9k tokens), a ~2.5k system text, and a second system message with the
  time, re-rendered on *every* request (so every turn of a session diverges from the previous
  turn inside the prompt, not at its end). Sessions of 4-9 turns; now and then the user edits
  an earlier question (not the last one).
* ``ops-mcp``: ``ops``'s tools plus two MCP tools appended, ``ops``'s system text: diverges
  from ``ops`` at the end of its tools block.
* ``ops-lite``: the first 6 of ``ops``'s tools plus 3 of its own, its own system text: diverges
  from ``ops`` inside the tools block, after the 6th tool.
* ``ops-helper``: a sub-agent of ``ops`` with ``ops``'s tools and its own system text.
* ``ops-sub``: a sub-agent with ``ops``'s system text but its own 2 tools (with the tools
  first, it shares nothing with ``ops`` but the template's first 3 tokens).
* ``writer-a/b/c``: three system-prompt variants (6 paragraphs, the 4th differs), same tools;
  ``writer-b`` and ``writer-c`` first appear after ``writer-a`` has run a while.
* ``stamp``: a scheduled agent whose system text *starts* with the time (a new minute every
  request), on ``writer``'s tools.

Each request carries what ``server_patch.boundaries`` computes for it: ``segments`` =
the tools end (before the system message's ``<|system|>``: exact, next to a special token), the
system content start (after it), the last ``paragraphs`` paragraph breaks of the system text
(2 tokens early: a plain-text seam gets the BPE slack; -1: all of them), the system end and
each message start; with ``tool_boundaries`` also the end of each tool (2 tokens early).
``anchor_len`` = the system end, or the last paragraph break when what follows it is shorter
than the anchor tail (256 tokens: the clock). Lengths at ``--scale tiny`` are divided by ~20.
"""

from __future__ import annotations

import argparse
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from apcctl.lab.sim.conversation import ASSISTANT, CLOCK_BASE, GMASK, SOP, SYSTEM, TIMESTAMP, USER, VOCAB
from apcctl.lab.sim.trace import Request, bundled_trace_path, write_trace
from apcctl.lab.sim.tracegen import SCALES, Scale, _Actor
from server_patch.boundaries import SegmentSettings

TOOL_SLACK = 2  # a tool boundary is plain text: the server moves it 2 tokens early
PARAGRAPH_SLACK = 2  # so is a paragraph break ("\n\n" then text)
PARAGRAPH = 16  # the "\n\n" token between paragraphs of a system text
ANCHOR_TAIL_TOKENS = SegmentSettings().anchor_tail_tokens


def bundled_firstsight_path(tool_boundaries: bool = False) -> Path:
    """The bundled first-sight trace (seed 7, 30 min), without or with tool boundaries."""
    name = "firstsight-tools.jsonl" if tool_boundaries else "firstsight.jsonl"
    return bundled_trace_path().with_name(name)


def clock_tokens(minute: int) -> np.ndarray:
    """'Current time: 2026-11-30 09:41' as 7 tokens; the minute token changes every minute."""
    when = CLOCK_BASE + dt.timedelta(minutes=minute)
    return np.asarray([TIMESTAMP, 900, 901, 2000 + when.month * 40 + when.day, 3000 + when.hour,
                       4000 + when.minute, 902], dtype=np.int32)


@dataclass(frozen=True)
class Agent:
    """Tools (one array each), system paragraphs, and where the time is rendered, if anywhere."""

    name: str
    tools: tuple[np.ndarray, ...]
    paragraphs: tuple[np.ndarray, ...]
    clock_at: int | None = None  # the time inside the first paragraph, at this offset
    clock_message: bool = False  # the time as its own system message (mlx-vlm appends it as a paragraph)

    @property
    def system(self) -> np.ndarray:
        return _join(list(self.paragraphs))

    def prefix(self, minute: int, tool_boundaries: bool,
               paragraphs: int = 2) -> tuple[np.ndarray, list[int], int]:
        """(rendered system+tools prefix, its segment boundaries, the anchor length)."""
        head = np.asarray([GMASK, SOP, SYSTEM], dtype=np.int32)
        parts, bounds, pos = [head], [], len(head)
        for tool in self.tools:
            parts.append(tool)
            pos += len(tool)
            if tool_boundaries:
                bounds.append(pos - TOOL_SLACK)
        bounds += [pos, pos + 1]  # the tools end (before <|system|>), the content start (after)
        body = list(self.paragraphs)
        if self.clock_at is not None:
            stamp = clock_tokens(minute)
            body[0] = np.concatenate([body[0][:self.clock_at], stamp, body[0][self.clock_at:]])
        if self.clock_message:
            body.append(clock_tokens(minute))
        pos += 1  # <|system|>
        breaks = []
        for k, paragraph in enumerate(body):
            if k:
                pos += 1  # the "\n\n" between paragraphs
                breaks.append(pos - PARAGRAPH_SLACK)
            pos += len(paragraph)
        if paragraphs >= 0:
            breaks = breaks[len(breaks) - paragraphs:] if paragraphs else []
        parts += [np.asarray([SYSTEM], dtype=np.int32), _join(body)]
        bounds += breaks + [pos]
        # The server's anchor leaves a trailing part shorter than its anchor tail (256 tokens)
        # out: a clock there would make a new anchor every minute.
        anchor = next(b for b in [*breaks, pos] if pos - b < ANCHOR_TAIL_TOKENS)
        return np.concatenate(parts).astype(np.int32), bounds, anchor


def _join(paragraphs: list[np.ndarray]) -> np.ndarray:
    out: list[np.ndarray] = []
    for k, paragraph in enumerate(paragraphs):
        if k:
            out.append(np.asarray([PARAGRAPH], dtype=np.int32))
        out.append(paragraph)
    return np.concatenate(out).astype(np.int32)


@dataclass
class Session:
    """Messages so far; renders the prompt a client would send (the whole conversation)."""

    id: str
    agent: Agent
    tool_boundaries: bool
    paragraphs: int = 2
    messages: list[np.ndarray] = field(default_factory=list)

    def add(self, role: int, content: np.ndarray) -> None:
        self.messages.append(np.concatenate([[role], content]).astype(np.int32))

    def request(self, t: float, kind: str) -> Request:
        prefix, bounds, anchor = self.agent.prefix(int(t // 60), self.tool_boundaries, self.paragraphs)
        pos = len(prefix)
        starts = []
        for message in self.messages[:-1]:
            pos += len(message)
            starts.append(pos)  # the end of one message is the start of the next
        tokens = np.concatenate([prefix, *self.messages, [ASSISTANT]]).astype(np.int32)
        return Request(conv=self.id, t=round(t, 3), tokens=tokens, anchor_len=anchor,
                       segments=tuple(sorted(set(bounds + starts))), kind=kind,
                       agent=self.agent.name.split("/")[0])


def make_agents(seed: int, scale: Scale) -> dict[str, Agent]:
    rng = np.random.default_rng([seed, 100])

    def draw(low: float, high: float) -> np.ndarray:
        return rng.integers(*VOCAB, size=scale.n(rng.uniform(low, high)), dtype=np.int32)

    ops_tools = tuple(draw(450, 1050) for _ in range(12))
    own_lite = tuple(draw(450, 900) for _ in range(3))
    mcp = tuple(draw(500, 900) for _ in range(2))
    sub_tools = tuple(draw(500, 800) for _ in range(2))
    writer_tools = tuple(draw(600, 1000) for _ in range(8))
    ops_system, lite_system, helper_system = (draw(2200, 2800),), (draw(1500, 2000),), (draw(1200, 1600),)
    paragraphs = tuple(draw(350, 550) for _ in range(6))

    def variant(k: int) -> tuple[np.ndarray, ...]:
        body = list(paragraphs)
        body[3] = np.random.default_rng([seed, 200, k]).integers(*VOCAB, size=len(paragraphs[3]),
                                                                  dtype=np.int32)
        return tuple(body)

    stamp_system = (draw(1800, 2400),)
    return {
        "ops": Agent("ops", ops_tools, ops_system, clock_message=True),
        "ops-mcp": Agent("ops-mcp", ops_tools + mcp, ops_system),
        "ops-lite": Agent("ops-lite", ops_tools[:6] + own_lite, lite_system),
        "ops-helper": Agent("ops-helper", ops_tools, helper_system),
        "ops-sub": Agent("ops-sub", sub_tools, ops_system),
        "writer-a": Agent("writer-a", writer_tools, paragraphs),
        "writer-b": Agent("writer-b", writer_tools, variant(1)),
        "writer-c": Agent("writer-c", writer_tools, variant(2)),
        "stamp": Agent("stamp", writer_tools, stamp_system, clock_at=0),
    }


class _Sessions(_Actor):
    """Sessions of one or more agents; optional edits of an earlier question and sub-agents."""

    def __init__(self, seed: int, stream: int, scale: Scale, horizon: float, tool_boundaries: bool,
                 paragraphs: int = 2) -> None:
        super().__init__(seed, stream, scale, horizon)
        self.tool_boundaries = tool_boundaries
        self.paragraphs = paragraphs
        self.count = 0

    def session(self, agent: Agent, name: str) -> Session:
        self.count += 1
        return Session(f"{name}/s{self.count - 1}", agent, self.tool_boundaries, self.paragraphs)

    def turns(self, sess: Session, t: float, n_turns: int, median: float, gap: tuple[float, float],
              first_kind: str, edit_p: float = 0.0, spawn=None) -> float:
        for turn in range(n_turns):
            if t >= self.horizon:
                break
            sess.add(USER, self.question())
            self.emit(sess, t, first_kind if turn == 0 else "turn")
            if turn >= 3 and self.rng.uniform() < edit_p:
                t = self._edit(sess, t)
            t = self.answer(sess, t + 1.0, median) + self.pause(*gap)
            if spawn is not None:
                t = spawn(sess, turn, t)
        return t

    def _edit(self, sess: Session, t: float) -> float:
        """The user rewrites an earlier question (the 2nd); the client re-sends the cut conversation."""
        t += self.pause(10, 30)
        keep = 3  # system prefix, then [user, assistant, user*]: the 2nd question is message 2
        sess.messages = sess.messages[:keep - 1]
        sess.add(USER, self.question())
        self.emit(sess, t, "edit")
        return t


def generate(seed: int = 7, scale: str = "full", minutes: float = 30.0,
             tool_boundaries: bool = False, paragraphs: int = 2) -> tuple[list[Request], dict[str, Any]]:
    """Requests in time order and the trace header's metadata."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; known: {', '.join(SCALES)}")
    sc, horizon = SCALES[scale], minutes * 60.0
    agents = make_agents(seed, sc)
    out: list[Request] = []

    # ops: sessions all along; helper and sub-agents spawned from it.
    ops = _Sessions(seed, 11, sc, horizon, tool_boundaries, paragraphs)

    def spawn(parent: Session, turn: int, t: float) -> float:
        if turn not in (2, 5):
            return t
        for k, name in enumerate(("ops-helper", "ops-sub")):
            sub = ops.session(agents[name], name)
            ops.turns(sub, t + 0.5 * k, int(ops.rng.integers(2, 4)), 200, (3, 8), "subagent")
        parent.add(USER, ops.tokens(sc.n(ops.rng.uniform(150, 300))))
        return t + ops.pause(20, 40)

    t = ops.pause(0, 20)
    while t < horizon:
        t = ops.turns(ops.session(agents["ops"], "ops"), t, int(ops.rng.integers(4, 10)), 350, (20, 60),
                      "new_session", edit_p=0.25, spawn=spawn) + ops.pause(30, 90)
    out += ops.out

    # ops-mcp and ops-lite: first seen a few minutes in, then a session now and then.
    for stream, name, start in ((12, "ops-mcp", 240.0), (13, "ops-lite", 360.0)):
        actor = _Sessions(seed, stream, sc, horizon, tool_boundaries, paragraphs)
        t = start + actor.pause(0, 30)
        while t < horizon:
            t = actor.turns(actor.session(agents[name], name), t, int(actor.rng.integers(2, 5)), 300,
                            (15, 45), "new_session") + actor.pause(240, 420)
        out += actor.out

    # writer: variant a from the start, b after 8 minutes, c after 16; sessions rotate.
    writer = _Sessions(seed, 14, sc, horizon, tool_boundaries, paragraphs)
    t, k = writer.pause(10, 40), 0
    while t < horizon:
        available = [n for n, at in (("writer-a", 0), ("writer-b", 480), ("writer-c", 960)) if t >= at]
        name = available[k % len(available)]
        t = writer.turns(writer.session(agents[name], name), t, int(writer.rng.integers(3, 7)), 400,
                         (20, 60), "new_session") + writer.pause(60, 150)
        k += 1
    out += writer.out

    # stamp: a short session every 2-4 minutes, the time first in its system text.
    stamp = _Sessions(seed, 15, sc, horizon, tool_boundaries, paragraphs)
    t = 90 + stamp.pause(0, 30)
    while t < horizon:
        stamp.turns(stamp.session(agents["stamp"], "stamp"), t, int(stamp.rng.integers(1, 3)), 200,
                    (10, 30), "scheduled")
        t += stamp.pause(120, 240)
    out += stamp.out

    requests = sorted(out, key=lambda r: r.t)
    for i, req in enumerate(requests):
        req.index = i
    meta = {
        "generator": "apcctl.lab.sim.tracegen_firstsight", "seed": seed, "scale": scale, "minutes": minutes,
        "tool_boundaries": tool_boundaries, "paragraphs": paragraphs,
        "agents": {name: {"tools": [len(x) for x in a.tools], "system": [len(p) for p in a.paragraphs]}
                   for name, a in agents.items()},
    }
    return requests, meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m apcctl.lab.sim.tracegen_firstsight", description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--scale", choices=sorted(SCALES), default="full")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--tool-boundaries", action="store_true",
                        help="segments include the end of each tool (the server's APC_SEGMENTS_TOOLS=1)")
    parser.add_argument("--paragraphs", type=int, default=2,
                        help="paragraph breaks per system text in the segments, the last ones (-1: all), "
                             "as the server's APC_SEGMENTS_SYSTEM_PARAGRAPHS")
    args = parser.parse_args(argv)
    requests, meta = generate(args.seed, args.scale, args.minutes, args.tool_boundaries, args.paragraphs)
    write_trace(args.out, requests, meta)
    print(f"{args.out}: {len(requests)} requests, {sum(r.n for r in requests):,} prompt tokens")


if __name__ == "__main__":
    main()


__all__ = ["Agent", "Session", "clock_tokens", "generate", "make_agents"]
