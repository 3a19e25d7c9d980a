"""The template study's verdicts on the saved GLM and Qwen3 templates (strings only, no weights)."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from apcctl.commands import bench_templates
from apcctl.lab.sim import template_study as ts

BY_NAME = {v.name: v for v in ts.VARIANTS}
CASES = {c.name: c for c in ts.CASES}


def result(variant: str, case: str) -> ts.Result:
    return ts.run_case(BY_NAME[variant], CASES[case])


@pytest.mark.parametrize("variant", ["glm45", "glm46", "glm45 nothink", "glm46 nothink", "glm47-flash nothink"])
def test_a_plain_reply_re_renders_verbatim_on_glm(variant):
    r = result(variant, "plain")
    assert r.verbatim and r.reply_chars_kept == len(r.generated) >= len(ts.CONTENT)
    assert ts.CONTENT in r.generated


@pytest.mark.parametrize("variant", ["glm45", "glm46"])
@pytest.mark.parametrize("case", ["think/content", "think/reasoning_content", "think/inline"])
def test_glm45_and_46_drop_reasoning_before_a_new_user_turn(variant, case):
    r = result(variant, case)
    assert not r.verbatim and r.reason.startswith("reasoning dropped")
    assert r.reply_chars_kept == len("\n<think>")  # the reply diverges right where the reasoning began


def test_glm47_keeps_reasoning_only_with_clear_thinking_false_and_the_field_resent():
    kept = result("glm47-flash keep", "think/reasoning_content")
    assert kept.verbatim
    assert not result("glm47-flash keep", "think/content").verbatim  # the client dropped it
    cleared = result("glm47-flash", "think/reasoning_content")
    # The generation prompt's "<think>" becomes "</think>" in history: inside the prompt's last token.
    assert cleared.diverges_at == cleared.prompt_len - len("think>")


@pytest.mark.parametrize("variant", ["glm45", "glm46", "glm47-flash", "qwen3"])
def test_a_tool_loop_keeps_resent_reasoning(variant):
    """A tool result is not a user turn, so the last user index does not move past the reply."""
    assert result(variant, "think+tool/reasoning_content").verbatim
    assert not result(variant, "think+tool/content").verbatim


def test_templates_trim_a_trailing_newline():
    r = result("glm46", "plain+newline")
    assert r.reason.startswith("trailing whitespace") and r.reply_chars_kept == len(r.generated) - 1


def test_qwen3_rewrites_the_empty_think_block():
    thinking = result("qwen3", "plain")
    assert thinking.reply_chars_kept == 0 and "<think>" in thinking.generated
    nothink = result("qwen3 nothink", "plain")
    assert nothink.diverges_at < nothink.prompt_len  # the prompt itself is not re-rendered
    assert nothink.diverges_at == nothink.prompt_len - len("<think>\n\n</think>\n\n")


@pytest.mark.parametrize(("tiny", "real"), [("tiny", "glm45"), ("tiny nothink", "glm45 nothink")])
def test_the_tiny_model_template_re_renders_like_glm45(tiny, real):
    """The end-to-end tests on the tiny model exercise the GLM-4.5 case: reusable plain replies."""
    variant = {v.name: v for v in ts.TINY_VARIANTS}[tiny]
    ours = {r.case: r for r in ts.study((variant,))}
    theirs = {r.case: r for r in ts.study((BY_NAME[real],))}
    assert ours.keys() == theirs.keys()
    for case, r in ours.items():
        assert r.verdict().split()[0] == theirs[case].verdict().split()[0], case
        assert r.reason.split(":")[0] == theirs[case].reason.split(":")[0], case
    assert ours["plain"].verbatim and ours["tool"].verbatim


def test_header_comments_render_as_nothing():
    for name in ("glm45.jinja", "glm46.jinja", "glm47_flash.jinja"):
        text = ts.render(ts.Variant(name, name), [{"role": "user", "content": "hi"}], add_generation_prompt=True)
        assert text.startswith("[gMASK]<sop><|user|>")
    qwen = ts.render(BY_NAME["qwen3"], [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert qwen == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_raise_exception_and_tojson_behave_like_transformers():
    assert ts._tojson({"city": "Zürich"}) == '{"city": "Zürich"}'
    with pytest.raises(ts.TemplateError, match="boom"):
        ts._raise("boom")


@click.group()
def main() -> None:
    """Only this module's commands."""


@main.group()
def bench() -> None:
    """The ``bench`` group."""


bench_templates.register(main, bench)


def test_cli_json_and_table():
    runner = CliRunner()
    out = runner.invoke(main, ["bench", "templates", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["errors"] == []
    rows = {(r["variant"], r["case"]): r for r in data["results"]}
    assert rows[("glm46", "plain")]["verbatim"] and not rows[("glm46", "think/content")]["verbatim"]
    assert ("glm46 nothink", "think/content") not in rows  # no reasoning where thinking is off
    assert any(variant == "tiny" for variant, _ in rows)
    table = runner.invoke(main, ["bench", "templates", "--variant", "qwen3"])
    assert table.exit_code == 0 and "qwen3" in table.output and "glm45" not in table.output
    bad = runner.invoke(main, ["bench", "templates", "--variant", "nope"])
    assert bad.exit_code != 0 and "nope" in bad.output
