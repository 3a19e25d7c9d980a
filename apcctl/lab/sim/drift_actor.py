"""The drift actor: a client that changes its prompt in each way issue 37 names, at a known place.

Each ``DriftCase`` is two requests of one client (its own namespace): a first prompt, then a
second one built from it (and from the reply the first got, for the reply cases) with one
change injected, and the cause and segment the server must name for the second
(``server_patch.drift``). ``tests/e2e/test_e2e_drift.py`` sends them to a real server and
reads the names back from ``/admin/requests``; ``apcctl bench trace-gen --drift`` renders them
into a replay trace (``kind``: ``drift:<cause>``), with a synthetic reply.

Prompts are chat messages (text), so they go through the server's own template, tokenizer and
segment finder. Lengths are in words (about one token each on the tiny models).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from apcctl.lab.sim.trace import Request

Messages = list[dict[str, Any]]

DATE, TOMORROW = "Today is 2026-12-05 17:15.", "Today is 2026-12-06 09:02."
REMINDER = "<system-reminder>\nThe current date is 2026-12-05. Use it when asked.\n</system-reminder>\n"
NOTE = "\n<note>\nThe previous build log is attached below for your reference only.\n</note>"


def _words(rng: random.Random, count: int) -> str:
    vocab = ("model token cache prompt prefix lineage snapshot layer attention linear sparse index pool "
             "path line code python test assert return class import def self none true false").split()
    return " ".join(rng.choice(vocab) for _ in range(count))


def _tool(name: str, rng: random.Random) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": _words(rng, 12),
                                             "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class DriftCase:
    """One injected change: ``first``, then ``then(reply_text)``; the second must be named
    ``cause`` in ``segment`` (a message's number and role as the server names it: "message 4
    (user)" is the fourth message, the system message first)."""

    name: str
    cause: str
    segment: str
    first: Messages
    then: Callable[[str], Messages]
    tools: list[dict[str, Any]] | None = None
    then_tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def cases(seed: int = 37) -> list[DriftCase]:
    """Every cause a real server can be shown on a tiny model (a reply re-rendered by its
    template needs a model that thinks, or a tokenizer that keeps whitespace: those are unit
    tests, ``tests/drift``)."""
    rng = random.Random(seed)
    system = "You are the drift actor's assistant. " + _words(rng, 60)
    task, reply, more = _words(rng, 50), _words(rng, 30), _words(rng, 15)

    def conv(*turns: tuple[str, str], sys_text: str = system) -> Messages:
        return [{"role": "system", "content": sys_text}, *({"role": r, "content": c} for r, c in turns)]

    tools = [_tool(name, rng) for name in ("read_file", "run_shell", "edit_file")]
    history = [("user", REMINDER + task), ("assistant", reply), ("user", more)]
    return [
        DriftCase("date", "date/time changed", "system", conv(("user", task), sys_text=f"{system} {DATE}"),
                  lambda r: conv(("user", task), ("assistant", r), ("user", more), sys_text=f"{system} {TOMORROW}")),
        DriftCase("moved", "block moved", "message 2 (user)", conv(("user", REMINDER + task), ("assistant", reply), ("user", more)),
                  lambda r: conv(("user", task), ("assistant", reply), ("user", more + "\n" + REMINDER))),
        DriftCase("removed", "block removed", "message 4 (user)", conv(("user", task), ("assistant", reply), ("user", more + NOTE)),
                  lambda r: conv(("user", task), ("assistant", reply), ("user", more), ("assistant", r), ("user", "go on"))),
        DriftCase("tools", "tools re-ordered", "tools", conv(("user", task)),
                  lambda r: conv(("user", task), ("assistant", r), ("user", more)), tools=tools,
                  then_tools=[tools[2], tools[0], tools[1]]),
        DriftCase("system", "system prompt edited", "system", conv(("user", task)),
                  lambda r: conv(("user", task), ("assistant", r), ("user", more),
                                 sys_text=system.replace("assistant.", "reviewer, strict and brief."))),
        DriftCase("resume", "history rebuilt on resume", "message 2 (user)", conv(*history),
                  lambda r: conv(("user", task), *history[1:], ("assistant", r), ("user", "go on"))),
        DriftCase("retry", "reply dropped on retry", "generation prompt", conv(("user", task)),
                  lambda r: conv(("user", task), ("user", "Format error: " + _words(rng, 20)))),
        DriftCase("reply", "reply re-rendered", "reply", conv(("user", task)),
                  lambda r: conv(("user", task), ("assistant", _rewritten(r)), ("user", more))),
        DriftCase("edit", "message edited", "message 4 (user)", conv(("user", task), ("assistant", reply), ("user", more)),
                  lambda r: conv(("user", task), ("assistant", reply), ("user", more.replace(" ", " edited ", 1)),
                                 ("assistant", r), ("user", "go on"))),
    ]


SYNTHETIC_REPLY = "I looked at the parser and fixed the off by one error in the tokenizer loop."


def generate(seed: int = 37, template: str = "qwen3.jinja") -> tuple[list[Request], dict[str, Any]]:
    """The cases as a replay trace, rendered with ``template`` by the server's own finder
    (``apcctl.lab.sim.tracegen_rendered``): per case its first request (with a synthetic reply)
    and the changed one, ``kind`` ``drift:<name>``, each case its own namespace."""
    from apcctl.lab.sim.tracegen_rendered import _Renderer

    renderer = _Renderer(template, system_points=True)
    requests: list[Request] = []
    for k, case in enumerate(cases(seed)):
        for step, (messages, tools) in enumerate(((case.first, case.tools),
                                                  (case.then(SYNTHETIC_REPLY), case.then_tools or case.tools))):
            tokens, info = renderer.request(messages, tools or [])
            req = Request(f"drift/{case.name}", 10.0 * k + step, tokens, info.anchor_len, tuple(info.segments),
                          namespace=f"drift-{case.name}", kind="new_session" if step == 0 else f"drift:{case.name}",
                          agent="drift", index=len(requests))
            if step == 0:
                req.reply = np.asarray(renderer.tokenizer.encode(SYNTHETIC_REPLY, add_special_tokens=False),
                                       dtype=np.int32)
            requests.append(req)
    meta = {"generator": "apcctl.lab.sim.drift_actor", "seed": seed, "template": template,
            "cases": {c.name: c.cause for c in cases(seed)}}
    return requests, meta


def _rewritten(reply: str) -> str:
    """The reply with its second word replaced: a client that re-renders it otherwise."""
    words = reply.split()
    return " ".join([*words[:1], "rewritten", *words[2:]]) if len(words) > 2 else reply + " rewritten"


__all__ = ["DriftCase", "SYNTHETIC_REPLY", "cases", "generate"]
