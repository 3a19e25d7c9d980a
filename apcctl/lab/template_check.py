"""Pre-flight for a model's chat template: where the system text sits, and which boundaries it gets.

A template that renders the system text *before* the tools block (Qwen3/3.5, Llama, Mistral,
gpt-oss: "system first") puts a late change in the system prompt (a date, a working directory)
ahead of the tools and everything after them; one that renders the tools first (GLM) keeps the
tools block a restore point whatever the system text says. ``check_template`` renders a probe
agent conversation (a long structured system prompt, two tools, a few turns) with the model
directory's own tokenizer and template through mlx-vlm's ``apply_chat_template``, exactly as the
server does, and runs the server's boundary finder (``server_patch.boundaries``) over it: the
boundary kinds it reports are the ones the server will offer the policy for such prompts.
Nothing but the tokenizer files is read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOOLS_FIRST, SYSTEM_FIRST = "tools first", "system first"
NO_TOOLS, NO_SYSTEM, NO_TEMPLATE = "tools not rendered", "system not rendered", "no chat template"
UNRENDERABLE = "does not render the probe"

_SYSTEM_MARK = "zq-system-probe"
_TOOL_MARK = "zq_tool_probe"
def _probe_system() -> str:
    """A long agent system prompt (about 1.5k tokens of lines: headings, rules, an ``<env>``
    block, the date last), so the finder's thinning has room to offer points inside it."""
    from apcctl.lab.tinymodel.agent_prompts import system_prompt

    return f"You are {_SYSTEM_MARK}, a coding agent.\n\n" + system_prompt()


PROBE_TOOLS = [
    {"type": "function", "function": {"name": _TOOL_MARK, "description": "Read a file.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "zq_second_tool", "description": "List a directory.",
                                      "parameters": {"type": "object", "properties": {}}}},
]
PROBE_MESSAGES = [
    {"role": "system", "content": _probe_system()},
    {"role": "user", "content": "Where is the main module?"},
    {"role": "assistant", "content": "In src/main.py."},
    {"role": "user", "content": "Read it, please."},
]


@dataclass
class TemplateReport:
    """The template's order and the boundary kinds the server's finder offers on the probe."""

    order: str
    kinds: list[str] = field(default_factory=list)  # sorted by first position in the prompt
    positions: dict[str, int] = field(default_factory=dict)  # kind -> its first token position
    prompt_tokens: int = 0
    anchor_len: int | None = None  # where the system + tools anchor ends on the probe
    source: str = ""  # how the boundaries were found: template, fallback (stride) or none
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def template_order(rendered: str) -> str:
    """Tools first or system first in a render of the probe with its tools."""
    system, tools = rendered.find(_SYSTEM_MARK), rendered.find(_TOOL_MARK)
    if system < 0:
        return NO_SYSTEM
    if tools < 0:
        return NO_TOOLS
    return TOOLS_FIRST if tools < system else SYSTEM_FIRST


def check_template(model_dir: Path, model_type: str) -> TemplateReport:
    """Render the probe with ``model_dir``'s tokenizer and template; the finder's kinds on it."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any tokenizer that does not load is reported
        return TemplateReport(NO_TEMPLATE, problems=[f"tokenizer not loadable: {type(exc).__name__}: {exc}"[:300]])
    if not getattr(tokenizer, "chat_template", None):
        return TemplateReport(NO_TEMPLATE, problems=["the tokenizer has no chat template"])
    return check_with(tokenizer, {"model_type": model_type})


def check_with(processor: Any, config: dict[str, Any]) -> TemplateReport:
    """``check_template`` for a loaded tokenizer/processor (tests pass their own)."""
    from mlx_vlm.prompt_utils import apply_chat_template

    from server_patch.boundaries import SegmentFinder
    from server_patch.boundaries.text import encoder

    kwargs = {"tools": PROBE_TOOLS, "add_generation_prompt": True}
    try:
        rendered = apply_chat_template(processor, config, PROBE_MESSAGES, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template that cannot render the probe is reported
        return TemplateReport(UNRENDERABLE, problems=[f"template does not render: {type(exc).__name__}: {exc}"[:300]])
    if not isinstance(rendered, str):
        return TemplateReport(UNRENDERABLE, problems=["template render is not text"])
    finder = SegmentFinder()
    finder.note(apply_chat_template, processor, config, PROBE_MESSAGES, kwargs, rendered)
    tokens = encoder(getattr(processor, "tokenizer", processor))(rendered)
    info = finder.boundaries(tokens)
    first: dict[str, int] = {}
    for position in sorted(info.kinds):
        first.setdefault(str(info.kinds[position]), int(position))
    report = TemplateReport(template_order(rendered), sorted(first, key=first.get), first, len(tokens),
                            info.anchor_len, info.source)
    if info.source != "template":
        report.problems.append("the template does not render piecewise: only stride boundaries")
    return report


__all__ = ["TemplateReport", "check_template", "check_with", "template_order"]
