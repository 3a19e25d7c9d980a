"""``apcctl model check`` on the chat template: its order (tools or system first) and the
boundary kinds the server's finder offers on an agent prompt, from the directory's own tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from apcctl.cli import main
from apcctl.lab.sim.template_study import template_source
from apcctl.lab.template_check import NO_TOOLS, SYSTEM_FIRST, TOOLS_FIRST, check_template, check_with, template_order


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    from apcctl.lab.tinymodel.servable import build_family_dir

    return build_family_dir("qwen3_5", tmp_path_factory.mktemp("tmpl") / "model")


def _with_template(src: Path, dest: Path, name: str) -> Path:
    shutil.copytree(src, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["chat_template"] = template_source(name)
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def test_the_order_is_read_from_where_the_probe_texts_render():
    assert template_order("<tools>zq_tool_probe</tools><system>zq-system-probe") == TOOLS_FIRST
    assert template_order("<system>zq-system-probe<tools>zq_tool_probe") == SYSTEM_FIRST
    assert template_order("<system>zq-system-probe") == NO_TOOLS


def test_chatml_renders_no_tools_and_offers_system_and_paragraph_points(qwen_dir):
    report = check_template(qwen_dir, "qwen3_5")
    assert report.order == NO_TOOLS and report.source == "template" and not report.problems
    assert {"system", "paragraph", "heading", "message"} <= set(report.kinds)
    assert report.positions["paragraph"] < report.positions["heading"] < report.positions["system"] \
        < report.positions["message"]
    # The probe's last section (<env>, the date) is within the anchor tail: the anchor ends there.
    assert report.positions["heading"] < report.anchor_len < report.positions["system"]


def test_qwen3_is_system_first_and_glm_tools_first(qwen_dir, tmp_path):
    from transformers import AutoTokenizer

    qwen3 = _with_template(qwen_dir, tmp_path / "qwen3", "qwen3.jinja")
    report = check_with(AutoTokenizer.from_pretrained(str(qwen3)), {"model_type": "qwen3"})
    assert report.order == SYSTEM_FIRST
    # Inside the system text, before the tools block (the system message ends past the tools):
    # its last section's start and the system text's end, where the tools block begins.
    assert {"section", "system_text"} <= set(report.kinds)
    assert report.positions["section"] < report.positions["system_text"] < report.positions["system"]
    glm = check_template(_with_template(qwen_dir, tmp_path / "glm", "glm45.jinja"), "qwen3_5")
    assert glm.order == TOOLS_FIRST and glm.positions["tools"] < glm.positions["system"]


def test_model_check_prints_the_template_and_json_carries_it(qwen_dir, tmp_path):
    glm = _with_template(qwen_dir, tmp_path / "glm", "glm45.jinja")
    shown = CliRunner().invoke(main, ["model", "check", str(glm)])
    assert shown.exit_code == 0, shown.output
    assert "chat template: tools first; boundaries offered on an agent prompt: tools" in shown.output
    assert "(anchor at token" in shown.output
    as_json = json.loads(_json_of(qwen_dir))
    assert as_json["template"]["order"] == NO_TOOLS and "system" in as_json["template"]["kinds"]
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(qwen_dir / "config.json", bare / "config.json")
    assert "chat template: not checked (no tokenizer files)" in CliRunner().invoke(
        main, ["model", "check", str(bare)]).output


def _json_of(model_dir: Path) -> str:
    result = CliRunner().invoke(main, ["model", "check", str(model_dir), "--json"])
    assert result.exit_code == 0, result.output
    return result.stdout
