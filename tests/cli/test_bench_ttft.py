"""``apcctl bench ttft`` reads each turn's split as JSON from the real servers, consistently.

Real servers (``server_patch.launch --copy-counter``) on the tiny model, a short
conversation per mode. Checked: what the bench reads from ``/admin/requests`` (patched) and
mlx-vlm's ``/metrics`` + usage (stock) agrees with the HTTP responses and with the cache's
own size; never a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apcctl.lab.bench import ttft as bench

pytestmark = pytest.mark.server

QUESTIONS = 2


def _run(model_dir: Path, mode: str, workdir: Path) -> tuple[list[bench.Turn], list]:
    return bench.run_mode(model_dir, mode, context=200, questions=QUESTIONS, max_tokens=4, workdir=workdir,
                          timeout=120, echo=lambda _msg: None)


@pytest.fixture(scope="module")
def patched(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[bench.Turn], list]:
    return _run(tiny_model_dir, "patched", tmp_path_factory.mktemp("ttft-patched"))


@pytest.fixture(scope="module")
def stock(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[bench.Turn], list]:
    return _run(tiny_model_dir, "stock", tmp_path_factory.mktemp("ttft-stock"))


def _latent_bytes_per_token(model_dir: Path) -> int:
    """float32 latent rows of every sparse-attention layer (what a restore copies at least)."""
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    layers = sum(1 for kind in text["layer_types"] if kind == "deepseek_sparse_attention")
    return layers * int(text["kv_lora_rank"]) * 4


def _check_token_split(turns: list[bench.Turn]) -> None:
    assert len(turns) == QUESTIONS + 1
    assert turns[0].restored_tokens == 0 and turns[0].prefilled_tokens == turns[0].prompt_tokens
    for before, turn in zip(turns, turns[1:]):
        # a warm turn restores at least the previous prompt's n - 1, never its own last token
        assert before.prompt_tokens - 1 <= turn.restored_tokens <= turn.prompt_tokens - 1
        assert turn.restored_tokens + turn.prefilled_tokens == turn.prompt_tokens
        assert turn.restored_tokens == turn.cached_tokens  # the server's record agrees with its usage


def test_patched_split_comes_from_admin_requests(patched, tiny_model_dir: Path) -> None:
    turns, sent = patched
    _check_token_split(turns)
    assert all(t.source == "/admin/requests" for t in turns)
    assert turns[0].restore_kind == "cold" and turns[0].kv_admission == ""
    per_token = _latent_bytes_per_token(tiny_model_dir)
    for turn in turns[1:]:
        assert turn.kv_admission in ("lent", "copied")
        assert set(turn.server) == {"lookup_ms", "admission_ms", "prefill_ms", "commit_ms", "ttft_ms"}
        assert turn.server["admission_ms"] >= turn.server["lookup_ms"] >= 0
        # copies per request: the record's (lookup -> first token) are part of the whole turn's
        assert all(turn.turn_copies.get(k, 0) >= v for k, v in turn.copies.items())
        merged = turn.copies.get("merge.kv", 0)
        if turn.kv_admission == "copied":  # the one merge copy: every restored latent row
            assert merged >= turn.restored_tokens * per_token
        else:  # lent: the entry's own buffer; only pooled index windows keep mlx-vlm's merge
            assert merged * 10 < turn.restored_tokens * per_token
    assert len(sent) == len(turns) and sent[1][-2]["role"] == "assistant"  # the reply was re-sent


def test_stock_split_comes_from_metrics(stock) -> None:
    turns, _ = stock
    _check_token_split(turns)
    for turn in turns:
        assert turn.source == "/metrics + usage"
        assert set(turn.server) == {"ttft_ms", "prefill_ms"} and turn.copies == {}
        assert turn.server["ttft_ms"] > 0
    # stock's restore clones the snapshot: counted from the counter file, per turn
    assert all(t.turn_copies.get("clone.kv", 0) > 0 for t in turns[1:])


def test_summary_and_forward_cases(patched, stock) -> None:
    turns = {"patched": patched[0], "stock": stock[0]}
    summary = bench.summarize(turns["patched"])
    assert summary["warm_turns"] == QUESTIONS
    assert summary["source"] == "/admin/requests"
    assert summary["restored_tokens"] + summary["prefilled_tokens"] >= min(t.prompt_tokens for t in turns["patched"][1:])
    cases = bench.forward_cases(turns, {"patched": patched[1], "stock": stock[1]})
    # greedy replies are equal, and both servers restore the same first warm turn: one case
    same = turns["patched"][1].restored_tokens == turns["stock"][1].restored_tokens and patched[1][1] == stock[1][1]
    assert [sorted(c["modes"]) for c in cases] == ([["patched", "stock"]] if same else [["patched"], ["stock"]])


def test_unknown_mode_is_a_cli_error() -> None:
    from click.testing import CliRunner

    from apcctl.cli import main

    result = CliRunner().invoke(main, ["bench", "ttft", "--modes", "stock,bogus"])
    assert result.exit_code == 2 and "unknown mode(s) bogus" in result.output
