"""deepseek_v4, served as it is: its own cold prefill depends on where a prompt is split.

On the tiny deepseek_v4 (ratio-4 compressed layers included): a lineage restore at L equals a
cold prefill split at L exactly, while the unsplit prefill differs; the measured split
dependence (``apcctl bench splits``) stays inside the canary's family term, which a
split-invariant family does not need; the canary passes this family's healthy restores only
with that term; and the server warns once at start, naming it.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from apcctl.lab.bench.splits import measure, measure_tiny
from apcctl.lab.tinymodel.families import build_language_model, forward
from server_patch.canary import check as C
from server_patch.canary import points as P
from server_patch.canary.compare import SPLIT_RTOL, TOLERANCES, tolerance_for
from server_patch.lineage import LineageCache, LineageConfig
from server_patch.state import splits
from server_patch.state.layout import CacheLayout


@pytest.fixture(scope="module")
def ds4():
    lm = build_language_model("deepseek_v4")
    assert 4 in lm.args.compress_ratios  # the overlap-compressed layers are there
    return lm, CacheLayout.from_model(lm)


def _run(lm, cache, tokens: np.ndarray, cuts=(), start: int = 0) -> np.ndarray:
    out, pos = None, start
    for stop in [*cuts, len(tokens)]:
        if pos < stop:
            out = forward(lm, tokens[pos:stop], cache)
            pos = stop
    mx.eval(out)
    return np.array(out).reshape(-1)


@pytest.mark.parametrize("cut", [37, 100, 129])
def test_a_restore_equals_a_cold_prefill_split_at_the_restore_point(ds4, cut):
    lm, layout = ds4
    tokens = np.random.default_rng(cut).integers(1, 250, 260).astype(np.int32)
    live = lm.make_cache()
    _run(lm, live, tokens[:cut])
    kv, snapshot = layout.split(live, cut)
    _run(lm, live, tokens[:220], start=cut)  # the entry moves on
    warm = _run(lm, layout.build(kv, snapshot, cut), tokens, start=cut)
    split_there = _run(lm, lm.make_cache(), tokens, cuts=[cut])
    unsplit = _run(lm, lm.make_cache(), tokens)
    np.testing.assert_array_equal(warm, split_there)
    assert np.abs(warm - unsplit).max() > 1e-3  # the model's own split dependence, not the restore's


def test_the_measured_split_dependence_is_inside_the_canary_term_and_needs_it(ds4):
    lm, _ = ds4
    got = measure(lm, vocab=250, prompts=2, splits=2)
    float32 = TOLERANCES["float32"]
    assert got.max_rel > float32[0] + float32[1]  # the dtype tolerance alone would fail healthy restores
    assert got.max_rel <= SPLIT_RTOL["deepseek_v4"]
    # A split-invariant family measures float rounding only: it gets no split term.
    (qwen,) = measure_tiny("qwen3_5", seeds=[0], prompts=2, splits=2)
    assert qwen.max_abs < 1e-4
    assert set(SPLIT_RTOL) == set(splits.SPLIT_DEPENDENT)


def test_the_family_term_is_added_and_the_overrides_still_win():
    base = tolerance_for("float32", {})
    ds4 = tolerance_for("float32", {}, family="deepseek_v4")
    assert ds4.rtol == pytest.approx(base.rtol + SPLIT_RTOL["deepseek_v4"]) and ds4.atol == base.atol
    assert tolerance_for("float32", {}, family="qwen3_5") == base
    assert tolerance_for("float32", {"APC_CANARY_RTOL": "0.01"}, family="deepseek_v4").rtol == 0.01


def test_the_canary_passes_healthy_deepseek_v4_restores_only_with_the_family_term(ds4):
    lm, layout = ds4
    tokens = np.random.default_rng(3).integers(1, 250, 300).astype(np.int32)
    live = lm.make_cache()
    _run(lm, live, tokens[:100], cuts=range(0, 100, 48))  # a server's chunked prefill
    checkpoint = layout.split(live, 100)[1]
    _run(lm, live, tokens[:299], cuts=range(100, 299, 64), start=100)
    kv, head = layout.split(live, 299)
    cache = LineageCache(LineageConfig())
    entry = cache.commit(tokens, kv=kv, head=head, captures={100: ("final", checkpoint)})
    points = P.of_entry(cache, entry.id)
    settings = C.Settings(chunk=128)

    def verdicts(tol):
        return [r.result for r in C.check_entry(lm, layout, entry, points, tol, settings, lambda: False)]

    assert verdicts(tolerance_for("float32", {}, family=splits.family_of(lm))) == ["pass", "pass"]
    assert "fail" in verdicts(tolerance_for("float32", {}))  # the split dependence, unallowed
    # A wrong state still fails with the family term: the head of another prompt at 299.
    other = lm.make_cache()
    _run(lm, other, np.random.default_rng(4).integers(1, 250, 299).astype(np.int32))
    elsewhere = LineageCache(LineageConfig())  # (the same tokens in ``cache`` would be the same entry)
    wrong = elsewhere.commit(tokens, kv=kv, head=layout.split(other, 299)[1], captures={})
    wrong_points = [p for p in P.of_entry(elsewhere, wrong.id) if p.kind == "entry"]
    tol = tolerance_for("float32", {}, family="deepseek_v4")
    results = C.check_entry(lm, layout, wrong, wrong_points, tol, settings, lambda: False)
    assert [r.result for r in results] == ["fail"], [r.reason for r in results]


def test_the_server_warns_once_naming_the_family(tmp_path, monkeypatch, capsys, ds4):
    from server_patch.launch import warn_split_dependent

    monkeypatch.setattr(splits, "_WARNED", set())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    warn_split_dependent(["--model", str(tmp_path)])
    warn_split_dependent(["--model", str(tmp_path)])
    lm, _ = ds4
    assert not splits.warn_once(splits.family_of(lm), print)  # the runtime's call: already said
    err = capsys.readouterr().err
    assert err.count("WARNING: deepseek_v4 is served with the lineage cache on") == 1
    assert "split at the restore point" in err and "APC_LINEAGE=0" in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    warn_split_dependent(["--model", str(tmp_path)])
    assert capsys.readouterr().err == ""


def test_bench_splits_reports_the_measure_and_whether_the_term_covers_it():
    from apcctl.cli import main

    result = CliRunner().invoke(main, ["bench", "splits", "--seeds", "0", "--prompts", "1", "--splits", "1"])
    assert result.exit_code == 0, result.output
    assert "deepseek_v4" in result.output and "covers it" in result.output
    bad = CliRunner().invoke(main, ["bench", "splits", "--family", "nope"])
    assert bad.exit_code != 0 and "no tiny model" in bad.output
