"""State sizes from the two bundled glm5_next configs, checked against hand arithmetic."""

from __future__ import annotations

import json

import pytest

from apcctl.lab.sim.sizes import load_sizes, sizes_from_config


def test_full_size_glm5_next_by_hand():
    s = load_sizes("full")
    assert (s.attention_layers, s.linear_layers, s.full_indexer_layers) == (11, 34, 11)
    assert s.dtype_bytes == 2
    assert s.latent_per_token == 11 * 512 * 2 == 11_264
    assert s.index_valid_per_token == 11
    assert s.pooled_keys_per_token == 11 * 128 * 2 // 16 == 176
    assert s.kv_per_token == 11_451  # ~11.2 KiB: the latent + index caches lineage stores
    assert s.projected_per_token == 11 * 64 * (256 + 256) * 2 == 720_896  # 64 KiB per layer
    assert s.recurrent_bytes == 34 * 64 * 128 * 128 * 4 == 142_606_336
    assert s.conv_bytes == 34 * 3 * (3 * 64 * 128) * 2 == 5_013_504
    assert s.snapshot_bytes == 147_619_840  # the post's "about 143 MB" (MiB: 140.8)


def test_full_snapshot_counts_projected_cache_only_up_to_32768_tokens():
    s = load_sizes("full")
    assert s.full_snapshot_bytes(10_000) == 10_000 * (11_451 + 720_896) + 147_619_840
    assert s.full_snapshot_bytes(40_000) - s.kv_bytes(40_000) - s.snapshot_bytes == 32_768 * 720_896
    assert s.full_snapshot_bytes(12_000) > 8 * (1 << 30)  # too big for stock's RAM tier


def test_tiny_model_by_hand():
    s = load_sizes("tiny")
    assert (s.attention_layers, s.linear_layers, s.full_indexer_layers, s.dtype_bytes) == (1, 2, 1, 4)
    assert s.kv_per_token == 32 * 4 + 1 + 16 * 4 // 16 == 133
    assert s.projected_per_token == 2 * (16 + 16) * 4 == 256
    assert s.recurrent_bytes == 2 * 2 * 32 * 32 * 4 == 16_384
    assert s.conv_bytes == 2 * 3 * (3 * 2 * 32) * 4 == 4_608
    assert s.snapshot_bytes == 20_992


def test_defaults_follow_glm5_next_config_post_init(tmp_path):
    """No layer/indexer lists: i % 4 == 3 is attention, every indexer is 'full'."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "glm5_next", "torch_dtype": "bfloat16", "text_config": {}}))
    derived, bundled = load_sizes(str(path)).describe(), load_sizes("full").describe()
    derived.pop("model"), bundled.pop("model")
    assert derived == bundled


def test_shared_indexer_layers_have_no_index_cache():
    # Attention layers are 3 and 7; layer 7 reuses layer 3's top-k and keeps no index cache.
    s = sizes_from_config({"text_config": {"num_hidden_layers": 8, "index_topk_pattern": "FFFFFFFS"}})
    assert (s.attention_layers, s.full_indexer_layers) == (2, 1)
    assert s.latent_per_token == 2 * 512 * 2
    assert s.index_valid_per_token == 1 and s.pooled_keys_per_token == 128 * 2 // 16


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype"):
        sizes_from_config({"torch_dtype": "int3"})
