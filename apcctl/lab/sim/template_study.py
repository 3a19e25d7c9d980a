"""Does turn k+1's rendered prompt start with turn k's prompt plus the reply the model generated?

Reply reuse (issue 13) keeps the generated tokens in the cache; they pay off only when the next
prompt, rendered by the model's chat template from the history a client re-sends, contains them
verbatim. This renders real templates (``apcctl/templates/*.jinja``) with no weights, the way
Hugging Face's ``apply_chat_template`` does (sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``,
``tojson`` and ``raise_exception``), and compares strings.

What the model generates is taken from the template itself: the text its rendering of a final
assistant turn adds after the generation prompt, cut at the end-of-turn marker (sampled, never
fed). Strings, not tokens: a verbatim string can still tokenise differently at the boundary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Callable

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SYSTEM = "You are a helpful assistant."
QUESTION, NEXT_QUESTION = "What should I wear in Paris today?", "And tomorrow?"
REASONING = "The user asks about clothes. I should check the weather first."
CONTENT = "Take a light jacket: it is 14 degrees and cloudy."
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_RESULT = '{"temp_c": 14, "sky": "cloudy"}'


@dataclass(frozen=True)
class Variant:
    """One template with the kwargs a client passes (``enable_thinking``, ``clear_thinking``)."""

    name: str
    template: str  # file under apcctl/templates, or "tiny" for apcctl.lab.tinymodel.template.CHAT_TEMPLATE
    kwargs: dict[str, Any] = field(default_factory=dict)
    end_marker: str | None = None  # what the model samples to end its turn (None: the next role tag)

    @property
    def thinking(self) -> bool:
        return self.kwargs.get("enable_thinking", True) is not False


@dataclass(frozen=True)
class Case:
    """A generated reply and how the client re-sends it in the next request's history."""

    name: str
    reasoning: bool  # the model reasoned before replying
    tool_call: bool  # the reply calls a tool; the next message is the tool's result
    resend: str  # "content": content only; "reasoning_content": the field kept; "inline": raw text
    trailing: str = ""  # whitespace the model emitted after its content


VARIANTS: tuple[Variant, ...] = (
    Variant("glm45", "glm45.jinja"),
    Variant("glm45 nothink", "glm45.jinja", {"enable_thinking": False}),
    Variant("glm46", "glm46.jinja"),
    Variant("glm46 nothink", "glm46.jinja", {"enable_thinking": False}),
    Variant("glm47-flash", "glm47_flash.jinja"),
    Variant("glm47-flash keep", "glm47_flash.jinja", {"clear_thinking": False}),
    Variant("glm47-flash nothink", "glm47_flash.jinja", {"enable_thinking": False}),
    Variant("qwen3", "qwen3.jinja", end_marker="<|im_end|>"),
    Variant("qwen3 nothink", "qwen3.jinja", {"enable_thinking": False}, end_marker="<|im_end|>"),
)

# The tiny test model's template (apcctl.lab.tinymodel.template.CHAT_TEMPLATE), with thinking on and with
# thinking off as mlx-vlm's server renders it by default: it should behave like glm45.
TINY_VARIANTS: tuple[Variant, ...] = (
    Variant("tiny", "tiny"),
    Variant("tiny nothink", "tiny", {"enable_thinking": False}),
)

CASES: tuple[Case, ...] = (
    Case("plain", reasoning=False, tool_call=False, resend="content"),
    Case("plain+newline", reasoning=False, tool_call=False, resend="content", trailing="\n"),
    Case("think/content", reasoning=True, tool_call=False, resend="content"),
    Case("think/reasoning_content", reasoning=True, tool_call=False, resend="reasoning_content"),
    Case("think/inline", reasoning=True, tool_call=False, resend="inline"),
    Case("tool", reasoning=False, tool_call=True, resend="content"),
    Case("think+tool/reasoning_content", reasoning=True, tool_call=True, resend="reasoning_content"),
    Case("think+tool/content", reasoning=True, tool_call=True, resend="content"),
)


@dataclass(frozen=True)
class Result:
    """Where ``prompt + generated`` stops being a prefix of the next prompt (None: it never does)."""

    variant: str
    case: str
    prompt_len: int
    generated: str
    diverges_at: int | None
    reason: str

    @property
    def verbatim(self) -> bool:
        return self.diverges_at is None

    @property
    def reply_chars_kept(self) -> int:
        """Characters of the generated reply that the next prompt repeats before it diverges."""
        if self.diverges_at is None:
            return len(self.generated)
        return max(0, self.diverges_at - self.prompt_len)

    def verdict(self) -> str:
        if self.diverges_at is None:
            return "verbatim"
        if self.diverges_at < self.prompt_len:
            return f"prompt −{self.prompt_len - self.diverges_at}"
        return f"reply {self.reply_chars_kept}/{len(self.generated)}"


class TemplateError(ValueError):
    """``raise_exception`` in a template, as Hugging Face raises it."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: ``json.dumps`` with ``ensure_ascii=False`` by default, no HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=None)
def template_source(name: str) -> str:
    if name == "tiny":
        from apcctl.lab.tinymodel.template import CHAT_TEMPLATE

        return CHAT_TEMPLATE
    return resources.files("apcctl").joinpath("templates", name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def _compiled(name: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(template_source(name))


def render(variant: Variant, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
           tools: list[dict[str, Any]] | None = None) -> str:
    return _compiled(variant.template).render(messages=messages, tools=tools,
                                              add_generation_prompt=add_generation_prompt, **variant.kwargs)


def _history() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def _assistant(case: Case, content: str, reasoning: str | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if case.tool_call:
        message["tool_calls"] = [TOOL_CALL]
    return message


def generated_text(variant: Variant, case: Case, prompt: str, tools: list[dict[str, Any]] | None) -> str:
    """What the model emits after ``prompt``: the template's own final assistant turn, past the prompt."""
    content = "" if case.tool_call else CONTENT
    # A reply without reasoning, where the generation prompt opens a think block (GLM-4.7's
    # "<think>"), is the model closing it at once: an empty reasoning (" " renders as "<think></think>").
    for reasoning in ((REASONING,) if case.reasoning else (None, " ")):
        final = render(variant, [*_history(), _assistant(case, content, reasoning)],
                       add_generation_prompt=False, tools=tools)
        if final.startswith(prompt):
            break
    else:
        raise ValueError(f"{variant.name}: the final assistant turn does not extend the generation prompt")
    text = final[len(prompt):]
    if variant.end_marker and variant.end_marker in text:
        text = text[:text.index(variant.end_marker)]
    return text + case.trailing


def run_case(variant: Variant, case: Case) -> Result:
    tools = TOOLS if case.tool_call else None
    prompt = render(variant, _history(), add_generation_prompt=True, tools=tools)
    generated = generated_text(variant, case, prompt, tools)
    content = ("" if case.tool_call else CONTENT) + case.trailing
    if case.resend == "inline":
        resent = _assistant(case, generated, None)
    else:
        resent = _assistant(case, content, REASONING if case.resend == "reasoning_content" else None)
    follow = ({"role": "tool", "content": TOOL_RESULT} if case.tool_call
              else {"role": "user", "content": NEXT_QUESTION})
    following = render(variant, [*_history(), resent, follow], add_generation_prompt=True, tools=tools)
    seen = prompt + generated
    at = _common_prefix(seen, following)
    if at == len(seen):
        return Result(variant.name, case.name, len(prompt), generated, None, "")
    return Result(variant.name, case.name, len(prompt), generated, at,
                  _reason(seen, following, at, len(prompt), generated))


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _reason(seen: str, following: str, at: int, prompt_len: int, generated: str) -> str:
    """A short why, from what the two strings hold at the divergence."""
    ours, theirs = seen[at:at + 14], following[at:at + 14]
    shown = f"{ours!r} vs {theirs!r}"
    if at < prompt_len:
        return f"history re-renders the generation prompt's last {prompt_len - at} chars: {shown}"
    offset = at - prompt_len
    think_end = generated.find("</think>")
    if REASONING[:8] in generated and (think_end < 0 or offset <= think_end + len("</think>")) \
            and REASONING[:8] in seen[at:]:
        return f"reasoning dropped from history: {shown}"
    if not seen[at:].strip():
        return f"trailing whitespace trimmed: {shown}"
    if think_end >= 0 and offset <= think_end + len("</think>") + 2:
        return f"think block re-rendered: {shown}"
    return f"history re-renders the reply: {shown}"


def study(variants: tuple[Variant, ...] = VARIANTS, cases: tuple[Case, ...] = CASES,
          on_error: Callable[[Variant, Case, Exception], None] | None = None) -> list[Result]:
    """Every applicable (variant, case); reasoning cases are skipped where thinking is off."""
    results = []
    for variant in variants:
        for case in cases:
            if case.reasoning and not variant.thinking:
                continue
            try:
                results.append(run_case(variant, case))
            except Exception as exc:  # noqa: BLE001 - one broken template must not hide the others
                if on_error is None:
                    raise
                on_error(variant, case, exc)
    return results
