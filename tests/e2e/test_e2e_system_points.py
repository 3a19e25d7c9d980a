"""A late change in a long system prompt, through the real patched server on qwen3_5.

The system prompt is written in lines (markdown headings over rule lines, an ``<env>`` block
with the working directory and the git status, a last line with the date) and no blank line,
so the finder has no paragraph break in it. A variant that differs in its last line (another
date) used to restore at the 2048-token stride; with points inside the system text it restores
at the start of its own section, within a few dozen tokens of where it diverges, and its answer
equals a cold prefill's: on ChatML (the system turn alone, the anchor moved before its last
section) and on a Qwen3-shaped template with the tools after the system text (a segment inside
the system text, before the tools and the anchor). ``python tests/e2e/test_e2e_system_points.py report [MODEL_DIR]`` prints the
before/after numbers of docs/benchmarks.md (restored tokens and checkpoint bytes held; without
MODEL_DIR it builds the tiny qwen3_5).
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
from pathlib import Path

import pytest

from tests.server_harness import PatchedServer, assert_same_output, cached_tokens, text
from server_patch.boundaries import BPE_SLACK

RULES = 80  # about 3k tokens of system text: past the 2048 stride
_cold = itertools.count()


def conversation(date: str, user_seed: int) -> list[dict]:
    from apcctl.lab.sim.tracegen_rendered import system_prompt

    return [{"role": "system", "content": system_prompt(date=date, rules=RULES)},
            {"role": "user", "content": text(30, user_seed)}]


def shared_tokens(model_dir: Path, a: list[dict], b: list[dict], **kwargs) -> tuple[int, int]:
    """Tokens the two prompts share, and where the ``<env>`` section starts (the last section
    of the system text), as the model's own tokenizer and template render them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = tok.apply_chat_template(a, tokenize=False, add_generation_prompt=True, **kwargs)
    x, y = (tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **kwargs),
                       add_special_tokens=False) for m in (a, b))
    shared = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return shared, len(tok.encode(rendered[:rendered.index("<env>")], add_special_tokens=False))


def measure(server: PatchedServer) -> dict:
    """A, then its variant B; what B restored and the checkpoint bytes held afterwards."""
    base, variant = conversation("2026-12-01", 1), conversation("2026-12-02", 2)
    server.chat(base, tenant="sys", max_tokens=2)
    answer = server.chat(variant, tenant="sys", max_tokens=4, logprobs=True, top_logprobs=5)
    line = server.lineage_lines("restore")[-1]
    status, body = server.admin("GET", "/entries?tier=ram")
    assert status == 200, body
    return {"restored": cached_tokens(answer), "kind": line["kind"], "answer": answer, "variant": variant,
            "checkpoint_bytes": sum(int(e["checkpoint_bytes"]) for e in body["entries"]),
            "checkpoints": sum(len(e["checkpoints"]) for e in body["entries"])}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from apcctl.lab.tinymodel.servable import build_family_dir

    return build_family_dir("qwen3_5", tmp_path_factory.mktemp("sysfirst") / "model")


def _server(model_dir: Path, log_dir: Path, **env: str) -> PatchedServer:
    return PatchedServer(model_dir, env={"TOP_LOGPROBS_K": "5", **env}, log_dir=log_dir)


@pytest.mark.server
def test_a_late_change_restores_at_its_own_section_and_equals_cold(model_dir, tmp_path):
    shared, section = shared_tokens(model_dir, conversation("2026-12-01", 1), conversation("2026-12-02", 2))
    assert shared > section > 2048 + 256
    with _server(model_dir, tmp_path / "before", APC_SEGMENTS_SYSTEM_PARAGRAPHS="0") as before:
        old = measure(before)
    assert (old["kind"], old["restored"]) == ("periodic", 2048)  # the stride fallback
    with _server(model_dir, tmp_path / "after") as after:
        new = measure(after)
        # At the start of its own section (a plain-text seam: up to BPE_SLACK tokens early).
        assert section - BPE_SLACK <= new["restored"] <= shared, (new["restored"], section, shared)
        cold = after.chat(new["variant"], tenant=f"cold-{next(_cold)}", max_tokens=4, logprobs=True,
                          top_logprobs=5)
        assert after.lineage_lines("restore")[-1]["kind"] == "cold"
        assert_same_output(new["answer"], cold)


# Qwen3's layout (apcctl/templates/qwen3.jinja, shortened): the system text, then the tools block,
# in one system turn. Content may come as text parts (mlx-vlm passes qwen3_5 messages that way).
QWEN_TOOLS_TEMPLATE = """{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- else -%}{%- for p in c -%}\
{%- if p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}
{%- if tools -%}<|im_start|>system
{% if messages[0].role == 'system' %}{{ text(messages[0].content) }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ text(messages[0].content) }}<|im_end|>
{% endif -%}
{%- for m in messages -%}{%- if not (m.role == 'system' and loop.first) -%}<|im_start|>{{ m.role }}
{{ text(m.content) }}<|im_end|>
{% endif -%}{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""


@pytest.mark.server
def test_with_the_tools_after_the_system_text_a_late_change_restores_before_the_tools(model_dir, tmp_path):
    """Qwen3's layout through the real server: the date variant diverges inside the system
    text, before the tools block and the anchor after it; it restores at its section's start
    (a segment the first request captured), and equals a cold prefill."""
    import shutil

    from apcctl.lab.sim.tracegen_rendered import tools

    qwen = tmp_path / "qwen-tools"
    shutil.copytree(model_dir, qwen)
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    (qwen / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN_TOOLS_TEMPLATE}))
    tool_list = tools(("read_file", "list_dir", "run_tests", "git_diff"))
    params = {"tools": tool_list, "max_tokens": 4, "logprobs": True, "top_logprobs": 5}
    with _server(qwen, tmp_path / "log") as server:
        server.chat(conversation("2026-12-01", 1), tenant="q", **params)
        first = server.lineage_lines("timing")[-1]
        answer = server.chat(conversation("2026-12-02", 2), tenant="q", **params)
        line = server.lineage_lines("restore")[-1]
        cold = server.chat(conversation("2026-12-02", 2), tenant="q-cold", **params)
    shared, section = shared_tokens(qwen, conversation("2026-12-01", 1), conversation("2026-12-02", 2),
                                    tools=tool_list)
    restored = cached_tokens(answer)
    anchor = int(next(c for c in first["captures"].split(",") if c.startswith("anchor@")).split("@")[1])
    assert line["kind"] == "segment" and shared < anchor - 256, (line, first, shared)  # before the tools
    assert section - BPE_SLACK <= restored <= shared, (restored, section, shared)
    assert_same_output(answer, cold)


def report(model_dir: Path) -> None:
    shared, section = shared_tokens(model_dir, conversation("2026-12-01", 1), conversation("2026-12-02", 2))
    rows = []
    for label, env in (("before (APC_SEGMENTS_SYSTEM_PARAGRAPHS=0)", {"APC_SEGMENTS_SYSTEM_PARAGRAPHS": "0"}),
                       ("after (default)", {})):
        with _server(model_dir, Path(tempfile.mkdtemp(prefix="sysfirst-")), **env) as srv:
            got = measure(srv)
        rows.append({"run": label, "shared": shared, "section_start": section, "restored": got["restored"],
                     "kind": got["kind"],
                     "checkpoints": got["checkpoints"], "checkpoint_bytes": got["checkpoint_bytes"]})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__" and sys.argv[1:2] == ["report"]:
    from apcctl.lab.tinymodel.servable import build_family_dir

    report(Path(sys.argv[2]) if len(sys.argv) > 2 else
           build_family_dir("qwen3_5", Path(tempfile.mkdtemp(prefix="sysfirst-model-")) / "model"))
