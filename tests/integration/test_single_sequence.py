"""The library's single-sequence path (``stream_generate`` with an APC manager) is lineage-aware.

It runs in a subprocess: the overlay must be installed before mlx-vlm is first imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from apcctl.lab.tinymodel.build import build_model

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    lineage = sys.argv[2] == "lineage"
    if lineage:
        from server_patch.overlay import install
        install()
    from mlx_vlm import load
    from mlx_vlm.apc import from_env
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(sys.argv[1])
    manager = from_env(model_namespace="single-sequence-test")
    msgs = [{"role": "system", "content": "You follow instructions. " * 40},
            {"role": "user", "content": "first question"}]
    for turn in range(3):
        prompt = apply_chat_template(processor, model.config, msgs)
        text, last = "", None
        for r in stream_generate(model, processor, prompt, max_tokens=4, temperature=0.0,
                                 apc_manager=manager):
            last, text = r, text + r.text
        print(json.dumps({"prompt_tokens": last.prompt_tokens, "cached": last.cached_tokens,
                          "text": text}))
        msgs += [{"role": "assistant", "content": text or "ok"},
                 {"role": "user", "content": f"question {turn}"}]
    if lineage:
        from server_patch.integration.runtime import runtime_of
        print(json.dumps({"entries": [[e.length, [c.kind for c in e.checkpoints]]
                                      for e in runtime_of(manager).cache.entries()]}))
""")


def run(model_dir: Path, tmp_path: Path, lineage: bool) -> list[dict]:
    env = dict(os.environ, APC_ENABLED="1", APC_DISK_ENABLED="0", APC_LINEAGE_DISK="0",
               HF_HUB_OFFLINE="1", APC_STATE_DIR=str(tmp_path / "state"),
               PYTHONPATH=str(REPO))
    mode = "lineage" if lineage else "stock"
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), mode], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", 0)


@pytest.fixture(scope="module")
def lineage_lines(model_dir, tmp_path_factory) -> list[dict]:
    """The lineage run's lines (three turns, then the entries), run once for both tests."""
    return run(model_dir, tmp_path_factory.mktemp("lineage"), lineage=True)


def test_stream_generate_hits_its_lineage_and_keeps_one_entry(lineage_lines):
    turns, summary = lineage_lines[:3], lineage_lines[3]
    assert turns[0]["cached"] == 0
    for previous, turn in zip(turns, turns[1:]):
        assert turn["cached"] == previous["prompt_tokens"] - 1
    # One entry per lineage; earlier turns are checkpoints (references, not snapshots).
    assert len(summary["entries"]) == 1
    length, kinds = summary["entries"][0]
    assert length == turns[-1]["prompt_tokens"] - 1 and kinds == ["final", "final"]


def test_stream_generate_output_matches_stock(model_dir, lineage_lines, tmp_path):
    lineage = lineage_lines[:3]
    stock = run(model_dir, tmp_path, lineage=False)
    assert [t["text"] for t in lineage] == [t["text"] for t in stock]
    assert [t["cached"] for t in lineage] == [t["cached"] for t in stock]
