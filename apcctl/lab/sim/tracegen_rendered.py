"""A trace of agent prompts rendered by a real chat template, with the server's own boundaries.

The other generators lay token ids out as GLM renders them. This one renders each request's
messages with a template from ``apcctl/templates`` (default ``qwen3.jinja``: the system text
*before* the tools block, in one system turn), tokenizes it with the tiny models' byte-level BPE
tokenizer (``apcctl.lab.tinymodel.servable``) and asks the server's ``SegmentFinder`` for the
request's segments and anchor, exactly as the server does for a rendered chat request. So the
replay (``apcctl bench replay TRACE --model-config ...``) measures the real finder's points on
that template through the policy.

The agents share one structured system prompt written in lines, with no blank line (an intro,
markdown headings over rule lines, an ``<env>`` section with the working directory and the git
status, and a last line with the date: no paragraph break for the finder to use), eight tools,
sessions of several turns:

* ``coder``: the base prompt, every session;
* ``coder-tomorrow``: the same prompt a day later (its last line differs);
* ``coder-status``: every session a different git status line (inside ``<env>``, 3 lines
  before the end);
* ``coder-sub``: the same system text with two other tools (a sub-agent).

``system_points=False`` renders the same trace with the finder as it was before system points
(paragraph breaks only), for a before/after comparison.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import numpy as np

from apcctl.lab.sim.trace import Request
from apcctl.lab.tinymodel.agent_prompts import system_prompt, tools
from apcctl.lab.tinymodel.agent_prompts import words as _words

TEMPLATES = ("qwen3.jinja", "glm45.jinja")
_TOOL_NAMES = ("read_file", "write_file", "list_dir", "run_tests", "search_code", "git_diff", "open_url", "ask_user")


class _Renderer:
    """Renders, tokenizes and asks the server's finder, as the server does for a chat request."""

    def __init__(self, template: str, system_points: bool) -> None:
        from transformers import PreTrainedTokenizerFast

        from apcctl.lab.sim import template_study as ts
        from apcctl.lab.tinymodel.servable import CONTROL_TOKENS, _tokenizer
        from server_patch.boundaries import SegmentFinder, SegmentSettings

        self.variant = ts.Variant(template, template)
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(),
                                                 additional_special_tokens=list(CONTROL_TOKENS))
        self.finder = SegmentFinder(replace(SegmentSettings(), system_points=system_points))

    def apply(self, processor: Any, config: Any, messages: list[dict[str, Any]], *,
              add_generation_prompt: bool = True, **kwargs: Any) -> str:
        from apcctl.lab.sim import template_study as ts

        return ts.render(self.variant, messages, add_generation_prompt=add_generation_prompt,
                         tools=kwargs.get("tools"))

    def request(self, messages: list[dict[str, Any]], tool_list: list[dict[str, Any]]) -> tuple[np.ndarray, Any]:
        kwargs = {"tools": tool_list, "add_generation_prompt": True}
        rendered = self.apply(self.tokenizer, "qwen3", messages, **kwargs)
        self.finder.template.note(self.apply, self.tokenizer, "qwen3", kwargs)
        self.finder.registry.note_request(self.apply, self.tokenizer, "qwen3", messages, kwargs,
                                          self.finder.hard_ids(self.tokenizer))
        self.finder.note(self.apply, self.tokenizer, "qwen3", messages, kwargs, rendered)
        ids = np.asarray(self.tokenizer.encode(rendered, add_special_tokens=False), dtype=np.int32)
        return ids, self.finder.boundaries(ids)


def generate(seed: int = 7, *, template: str = "qwen3.jinja", sessions: int = 6, turns: tuple[int, int] = (3, 5),
             system_points: bool = True) -> tuple[list[Request], dict[str, Any]]:
    """The trace's requests in time order, and its header."""
    rng = random.Random(seed)
    renderer = _Renderer(template, system_points)
    base_tools, sub_tools = tools(_TOOL_NAMES), tools(("spawn_task", "report"), seed=9)
    agents = {
        "coder": lambda i: (system_prompt(), base_tools),
        "coder-tomorrow": lambda i: (system_prompt(date="2026-12-02"), base_tools),
        "coder-status": lambda i: (system_prompt(status=f"{i + 1} files modified: src/mod{i}.py"), base_tools),
        "coder-sub": lambda i: (system_prompt(), sub_tools),
    }
    plan: list[tuple[float, str, int]] = []
    for agent in agents:
        start = 60.0 if agent == "coder" else 600.0
        plan += [(start + 400.0 * i + rng.random() * 30, agent, i) for i in range(sessions)]
    requests: list[Request] = []
    for t0, agent, i in sorted(plan):
        system, tool_list = agents[agent](i)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for turn in range(rng.randint(*turns)):
            messages.append({"role": "user", "content": _words(rng, rng.randint(12, 40))})
            tokens, info = renderer.request(messages, tool_list)
            requests.append(Request(f"{agent}/s{i}", t0 + 40.0 * turn, tokens, info.anchor_len,
                                    tuple(info.segments), kind="new_session" if turn == 0 else "turn",
                                    agent=agent))
            messages.append({"role": "assistant", "content": _words(rng, rng.randint(20, 60))})
    requests.sort(key=lambda r: r.t)
    for index, req in enumerate(requests):
        req.index = index
    meta = {"generator": "apcctl.lab.sim.tracegen_rendered", "seed": seed, "template": template,
            "system_points": system_points, "sessions": sessions}
    return requests, meta


__all__ = ["TEMPLATES", "generate", "system_prompt", "tools"]
