"""The family listing, the pre-flight ``apcctl model check``, the refusals, and docs/models.md."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from apcctl.lab.tinymodel import families as tiny_families
from apcctl.cli import main
from apcctl.lab.model_check import PROBE_TOKENS, check_language_model, check_model_dir
from server_patch.state.families import all_families, inspect_family, model_families
from server_patch.state.layout import CacheLayout
from server_patch.state.registry import UnsupportedCacheError, check_options, codec_for

REPO = Path(__file__).resolve().parents[2]

# Hybrid families the issue names: the listing must find them from the installed package.
NAMED_HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear", "nemotron_h", "falcon_h1",
                 "jamba", "granitemoehybrid", "lfm2", "bailing_moe_linear", "plamo2vl", "baichuan_m1"]


def _write_config(tmp_path: Path, family: str, **extra) -> Path:
    directory = tmp_path / family
    directory.mkdir()
    config = {**tiny_families.tiny_config(family), "torch_dtype": "float32", **extra}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_listing_reads_every_package_and_finds_the_hybrids():
    listing = {f.family: f for f in all_families()}
    assert set(listing) == set(model_families()) and len(listing) > 200
    for name in NAMED_HYBRIDS:
        assert listing[name].hybrid, name
    for name in ("mamba", "mamba2", "rwkv7"):
        assert listing[name].classes == ("ArraysCache",)
    assert listing["qwen3_5"].classes == ("ArraysCache", "KVCache")
    assert listing["gemma3_text"].classes == ("KVCache", "RotatingKVCache")
    assert listing["llama4"].sliding and "ChunkedKVCache" in listing["llama4"].classes
    # A family without make_cache gets make_prompt_cache's default; a local import is followed.
    assert inspect_family("qwen2").classes == ("KVCache",) and not inspect_family("qwen2").has_make_cache
    assert inspect_family("cohere").classes == ("KVCache",)


def test_committed_models_md_is_the_matrix_command_output():
    result = CliRunner().invoke(main, ["model", "matrix", "--markdown"])
    assert result.exit_code == 0, result.output
    assert (REPO / "docs" / "models.md").read_text(encoding="utf-8") == result.output, \
        "docs/models.md is stale: run `apcctl model matrix --markdown > docs/models.md`"


def test_matrix_json_rows():
    result = CliRunner().invoke(main, ["model", "matrix", "--json"])
    rows = {r["family"]: r for r in json.loads(result.output)}
    assert rows["qwen3_5"]["path"] == "lineage" and rows["qwen3_5"]["tested"].startswith("tiny model")
    assert rows["qwen2"]["path"] == "stock block cache"
    assert rows["qwen4_exp"]["path"] == "refused: no restore rule for QSAKVCache"


def _real_sizes(lm, tokens: int) -> tuple[int, int]:
    """(KV bytes per token, snapshot bytes) of a real prefill, as the lineage handles count them."""
    layout = CacheLayout.from_model(lm)
    live = lm.make_cache()
    tiny_families.forward(lm, np.arange(1, tokens + 1), live)
    kv, snap = layout.split(live, tokens)
    return kv.nbytes // tokens, snap.nbytes


def test_check_sizes_equal_a_real_prefill_of_the_random_model(tmp_path):
    report = check_model_dir(_write_config(tmp_path, "qwen3_5"))
    assert report.supported and report.server_path == "lineage"
    assert [l.classes for l in report.layers] == [["ArraysCache"]] * 3 + [["KVCache"]]
    assert report.layers[0].rules[0].startswith("snapshot")
    assert report.layers[3].rules[0].startswith("append-only")
    lm = tiny_families.build_language_model("qwen3_5")
    assert (report.kv_bytes_per_token, report.snapshot_bytes) == _real_sizes(lm, PROBE_TOKENS)
    # Bytes per token do not depend on the length; the recurrent snapshot does not either.
    assert (report.kv_bytes_per_token, report.snapshot_bytes) == _real_sizes(lm, 3 * PROBE_TOKENS)


def test_check_counts_a_sliding_window_at_full_size(tmp_path):
    report = check_model_dir(_write_config(tmp_path, "gemma3_text"))
    window = tiny_families.COMMON["sliding_window"]
    sliding = [l for l in report.layers if l.classes == ["RotatingKVCache"]]
    full = [l for l in report.layers if l.classes == ["KVCache"]]
    assert sliding and full
    # Same heads and head_dim: a window of 8 rows holds 8 tokens of a full layer's KV.
    assert all(l.snapshot_bytes == window * full[0].kv_bytes_per_token for l in sliding)


def test_glm5_next_dir_keeps_the_projected_cache_out(tiny_model_dir):
    result = CliRunner().invoke(main, ["model", "check", str(tiny_model_dir), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["supported"] and report["server_path"] == "lineage"
    attention = [l for l in report["layers"] if l["classes"][0] == "CacheList"]
    assert attention and all(l["rules"][-1].startswith("derived") for l in attention)
    assert report["kv_bytes_per_token"] > 0 and report["snapshot_bytes"] > 0
    assert "no weights read" in report["probe"]


def test_check_refuses_a_class_without_restore_rule(tmp_path, monkeypatch):
    monkeypatch.setitem(tiny_families.FAMILIES, "qwen4_exp", {})
    result = CliRunner().invoke(main, ["model", "check", str(_write_config(tmp_path, "qwen4_exp"))])
    assert result.exit_code == 1
    assert "supported: NO" in result.output and "QSAKVCache" in result.output


def test_check_of_a_plain_kv_model_says_stock(tmp_path, monkeypatch):
    monkeypatch.setitem(tiny_families.FAMILIES, "llama", {})  # no layer_types: every layer full
    report = check_model_dir(_write_config(tmp_path, "llama"))
    assert report.server_path == "stock block cache" and report.supported
    assert report.snapshot_bytes == 0 and report.kv_bytes_per_token == 4 * 2 * 2 * 16 * 4


def test_check_without_config_is_a_cli_error(tmp_path):
    result = CliRunner().invoke(main, ["model", "check", str(tmp_path)])
    assert result.exit_code != 0 and "config.json" in result.output


def test_uniform_kv_bits_is_served_and_turboquant_refused_naming_the_option():
    from mlx_vlm.models.cache import QuantizedKVCache

    assert check_options("4").bits == 4  # --kv-bits 4: QuantizedKVCache, restored by its codec
    assert codec_for(QuantizedKVCache(64, 4)).name == "qkv4g64"
    with pytest.raises(UnsupportedCacheError, match="--kv-bits 3.5.*APC_LINEAGE=0"):
        check_options("3.5")
    check_options(None)
    check_options("")


def test_check_language_model_of_an_unprobeable_model_still_classifies():
    class NoForward:
        def make_cache(self):
            from mlx_vlm.models.cache import ArraysCache, KVCache

            return [ArraysCache(2), KVCache()]

        def __call__(self, *args, **kwargs):
            raise RuntimeError("no forward here")

    report = check_language_model(NoForward())
    assert report.supported and report.server_path == "lineage"
    assert any("probe forward failed" in p for p in report.problems)


def test_replay_sizes_of_a_checked_model(tmp_path):
    from apcctl.lab.sim.sizes import load_sizes, sizes_from_report

    report = check_model_dir(_write_config(tmp_path, "qwen3_5"))
    sizes = sizes_from_report(report)
    assert sizes.kv_per_token == report.kv_bytes_per_token and sizes.snapshot_bytes == report.snapshot_bytes
    # A stock snapshot at n tokens holds the KV rows and the recurrent state, nothing derived.
    assert sizes.full_snapshot_bytes(1000) == 1000 * report.kv_bytes_per_token + report.snapshot_bytes

    # What `apcctl bench replay --model-config` reads for any family, not only glm5_next.
    replay = load_sizes(str(tmp_path / "qwen3_5" / "config.json"))
    assert (replay.kv_per_token, replay.snapshot_bytes) == (sizes.kv_per_token, sizes.snapshot_bytes)


def test_kv_bits_is_read_from_the_server_arguments_or_the_environment():
    from server_patch.state.options import kv_bits_of

    assert kv_bits_of(["--model", "m", "--kv-bits", "4"], {}) == "4"
    assert kv_bits_of(["--kv-bits=3.5"], {"KV_BITS": "8"}) == "3.5"
    assert kv_bits_of(["--model", "m"], {"KV_BITS": "8"}) == "8"
    assert kv_bits_of(["--model", "m"], {}) is None


def test_full_size_glm5_next_config_checks_without_weights_and_matches_the_simulator(tmp_path):
    """The full-size config (45 layers), no weight file: placeholder parameters cost no memory; the
    probe's sizes agree with the simulator's independent derivation from the config."""
    from importlib import resources

    from apcctl.lab.sim.sizes import load_sizes

    (tmp_path / "config.json").write_text(
        resources.files("apcctl.lab.sim").joinpath("configs", "glm5_next_full.json").read_text())
    report = check_model_dir(tmp_path)
    sim = load_sizes("full")
    assert report.supported and len(report.layers) == 45
    assert report.kv_bytes_per_token == sim.kv_per_token
    # The probe also counts each attention layer's pooling buffer (kpool-1 buffered keys and
    # gates), which the simulator leaves out: the rest is the KDA recurrent + conv state.
    pooling = [l.snapshot_bytes for l in report.layers if "PoolingCache" in l.classes]
    assert len(pooling) == sim.full_indexer_layers
    assert report.snapshot_bytes - sum(pooling) == sim.snapshot_bytes


def test_the_launcher_refuses_turboquant_kv_bits_at_start(tmp_path: Path) -> None:
    """A TurboQuant KV cache (fractional --kv-bits) has no restore rule: the server must stop
    before loading anything, naming the option, not fail at the first store."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "APC_LINEAGE_DISK_PATH": str(tmp_path / "disk"), "APC_STATE_DIR": str(tmp_path / "state"),
           "APC_ADMIN_TOKEN": "t", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "server_patch.launch", "--model", str(tmp_path / "none"),
                           "--kv-bits", "3.5"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--kv-bits 3.5" in done.stderr and "APC_LINEAGE=0" in done.stderr, done.stderr
    assert not (tmp_path / "disk").exists()  # refused before the disk tier was touched
