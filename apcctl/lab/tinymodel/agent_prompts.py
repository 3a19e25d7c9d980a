"""An agent's system prompt and tools, written from the corpus's words (deterministic by seed).

Lives with the corpus, below the simulator and the checks: the rendered trace
(``apcctl.lab.sim.tracegen_rendered``) sends these prompts, and ``apcctl.lab.template_check`` probes a
chat template with the same system text, so neither has to import the other.
"""

from __future__ import annotations

import random
from typing import Any

from apcctl.lab.tinymodel.corpus import WORDS


def words(rng: random.Random, count: int) -> str:
    """``count`` corpus words drawn by ``rng``."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


def system_prompt(*, date: str = "2026-12-01", status: str = "clean", seed: int = 3, rules: int = 24) -> str:
    """The agents' structured system prompt (the same text for a seed, but for its variables)."""
    rng = random.Random(seed)
    lines = [f"You are a coding agent. {words(rng, 40)}", "# Rules"]
    lines += [f"- {words(rng, 24)}" for _ in range(rules)]
    lines += ["# Style"] + [f"- {words(rng, 20)}" for _ in range(16)]
    lines += ["<env>", "Working directory: /work/project", f"Git status: {status}", "</env>",
              f"Today's date: {date}."]
    return "\n".join(lines)


def tools(names: tuple[str, ...], seed: int = 5) -> list[dict[str, Any]]:
    """One function tool per name, with corpus descriptions (the same for a seed)."""
    rng = random.Random(seed)
    return [{"type": "function", "function": {
        "name": name, "description": words(rng, 60),
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": words(rng, 12)}},
                       "required": ["path"]}}} for name in names]
