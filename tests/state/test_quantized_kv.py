"""Quantized KV (``--kv-bits``): the packed codec on real mlx arrays and a real tiny model.

``QuantizedKVCache`` packs every token row on its own (groups run along the head dimension), so
rows [:n] of a longer packed state are the state a prefill of n tokens writes, whatever n is:
inside mlx-vlm's 256-row allocation step, off the 64-wide group size, at 1. These tests
check that claim on the arrays, then that a restore at such an n continues exactly as a cold
quantized prefill does, and what the layout refuses.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.cache import BatchQuantizedKVCache, KVCache, QuantizedKVCache

from server_patch.state import quantized, rows
from server_patch.state.layout import CacheLayout, MlxKV
from server_patch.state.options import KVQuant, UnsupportedCacheError, check_options, kv_quant_of
from server_patch.state.registry import codec_for, packed_codec
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

Q8 = KVQuant(8, 64)
# Odd lengths: mid allocation step (256), off the group size, 1 and a whole step.
CUTS = [1, 63, 100, 256, 257, 301]


def _kv(tokens: int, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((1, 2, tokens, 64)), mx.random.normal((1, 2, tokens, 64))


def _fill(cache, keys: mx.array, values: mx.array, step: int):
    for start in range(0, int(keys.shape[2]), step):
        cache.update_and_fetch(keys[:, :, start:start + step], values[:, :, start:start + step])
    return cache


def _packed(cache) -> list[np.ndarray]:
    n = int(cache.offset) if not isinstance(cache.offset, mx.array) else int(cache._idx)
    return [np.array(part[..., :n, :]) for part in (*cache.keys, *cache.values)]


@pytest.mark.parametrize("bits", [4, 8])
def test_token_rows_are_packed_on_their_own_so_chunking_never_changes_them(bits):
    keys, values = _kv(400, 1)
    whole = _fill(QuantizedKVCache(64, bits), keys, values, 400)
    chunked = _fill(QuantizedKVCache(64, bits), keys, values, 37)
    for a, b in zip(_packed(whole), _packed(chunked)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("bits", [4, 8])
def test_restore_at_any_row_continues_exactly_as_a_cold_quantized_cache(cut, bits):
    quant = KVQuant(bits, 64)
    codec = packed_codec(quant)
    keys, values = _kv(420, 2)
    live = _fill(QuantizedKVCache(64, bits), keys, values, 128)  # an entry past the restore point
    stored, snapshot = codec.split(live)
    assert snapshot == {} and set(stored) == set(quantized.PARTS)

    restored = codec.build(stored, snapshot, cut)
    assert restored.offset == cut and all(int(p.shape[2]) == cut for p in restored.keys)
    _fill(restored, keys[:, :, cut:], values[:, :, cut:], 50)  # the suffix, in other chunks
    cold = _fill(QuantizedKVCache(64, bits), keys, values, 420)
    for a, b in zip(_packed(restored), _packed(cold)):
        np.testing.assert_array_equal(a, b)
    # The stored rows are untouched by the restored cache's writes.
    again = codec.build(stored, {}, 420)
    for a, b in zip(_packed(again), _packed(cold)):
        np.testing.assert_array_equal(a, b)


def test_a_restore_past_the_stored_rows_or_of_another_width_fails():
    keys, values = _kv(100, 3)
    live = _fill(QuantizedKVCache(64, 8), keys, values, 100)
    stored, _ = packed_codec(Q8).split(live)
    with pytest.raises(ValueError, match="hold 100 tokens"):
        packed_codec(Q8).build(stored, {}, 101)
    with pytest.raises(UnsupportedCacheError, match="8 bits"):
        packed_codec(KVQuant(4, 64)).split(live)
    with pytest.raises(UnsupportedCacheError, match="KVCache"):
        packed_codec(Q8).split(KVCache())
    assert codec_for(live).name == "qkv8g64"


@pytest.mark.parametrize("copy", [True, False])
def test_a_batch_row_is_read_after_its_left_padding(copy):
    keys, values = _kv(90, 4)
    other_k, other_v = _kv(90, 5)
    batch = BatchQuantizedKVCache([10, 0], group_size=64, bits=8)
    both_k = mx.concatenate([mx.pad(keys[:, :, :80], [(0, 0), (0, 0), (10, 0), (0, 0)]), other_k])
    both_v = mx.concatenate([mx.pad(values[:, :, :80], [(0, 0), (0, 0), (10, 0), (0, 0)]), other_v])
    batch.update_and_fetch(both_k, both_v)
    row = quantized.row(batch, 0, 77, copy)
    alone = _fill(QuantizedKVCache(64, 8), keys[:, :, :77], values[:, :, :77], 77)
    for a, b in zip(_packed(row), _packed(alone)):
        np.testing.assert_array_equal(a, b)
    assert quantized.fed_lengths(batch, 0) == {80}
    with pytest.raises(ValueError, match="holds 80"):
        quantized.row(batch, 0, 81, copy)


def test_packed_handles_size_copy_and_trim_their_used_rows_only():
    keys, values = _kv(300, 6)
    live = _fill(QuantizedKVCache(64, 8), keys, values, 300)  # a 512-row buffer, 300 used
    stored, _ = packed_codec(Q8).split(live)
    kv = MlxKV([[stored]], 300)
    per_row = sum(int(stored[p].nbytes) // 300 for p in quantized.PARTS)
    assert kv.nbytes == per_row * 300
    prefix = kv.prefix(120)
    assert prefix.nbytes == per_row * 120 and prefix.layers[0][0]["k_data"].shape[2] == 120
    assert all(int(v.shape[2]) == 300 for v in kv.trimmed_layers()[0][0].values())


@pytest.fixture(scope="module")
def qwen():
    """A tiny qwen3_5 whose attention heads ``mx.quantize`` can pack (head_dim 64), with an
    attention layer that is not the last (mlx-vlm keeps the last layer in float)."""
    from apcctl.lab.tinymodel.families import build_language_model

    return build_language_model("qwen3_5", overrides={"head_dim": 64, "full_attention_interval": 2})


def test_the_layout_packs_the_layers_mlx_vlm_quantizes(qwen):
    assert CacheLayout.from_model(qwen, Q8).describe() == "arrays;qkv8g64;arrays;kv"
    assert CacheLayout.from_model(qwen, KVQuant(4, 32)).describe() == "arrays;qkv4g32;arrays;kv"
    assert CacheLayout.from_model(qwen).describe() == "arrays;kv;arrays;kv"
    assert CacheLayout.from_model(qwen, Q8).packed and not CacheLayout.from_model(qwen).packed
    assert CacheLayout.from_model(qwen, Q8).kv_quant_label == "qkv8g64" and not CacheLayout.from_model(qwen).kv_quant_label
    fresh = CacheLayout.from_model(qwen, Q8).fresh(qwen)
    assert [type(c).__name__ for c in fresh] == ["ArraysCache", "QuantizedKVCache", "ArraysCache", "KVCache"]


def _prefill(model, cache, tokens: np.ndarray, step: int) -> mx.array:
    from apcctl.lab.tinymodel.families import forward

    out = None
    for start in range(0, len(tokens), step):
        out = forward(model, tokens[start:start + step], cache)
    mx.eval(out)
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("cut", [63, 100, 129])
def test_a_quantized_model_restored_mid_step_equals_its_cold_quantized_prefill(qwen, bits, cut):
    layout = CacheLayout.from_model(qwen, KVQuant(bits, 64))
    prompt = np.random.default_rng(7).integers(0, 250, 260)
    live = layout.fresh(qwen)
    _prefill(qwen, live, prompt[:cut], step=cut)
    kv, snapshot = layout.split(live, cut)
    _prefill(qwen, live, prompt[cut:200], step=50)  # the live cache moves on
    restored = layout.build(kv, snapshot, cut)
    assert type(restored[1]) is QuantizedKVCache and restored[1].offset == cut
    warm = _prefill(qwen, restored, prompt[cut:], step=len(prompt) - cut)
    # A cold prefill split where the restore split it computes the same function in the same
    # order; split elsewhere it differs only by float rounding.
    cold_split = layout.fresh(qwen)
    _prefill(qwen, cold_split, prompt[:cut], step=cut)
    cold = _prefill(qwen, cold_split, prompt[cut:], step=len(prompt) - cut)
    np.testing.assert_allclose(np.array(warm), np.array(cold), atol=1e-5)
    whole = _prefill(qwen, layout.fresh(qwen), prompt, step=len(prompt))
    np.testing.assert_allclose(np.array(warm), np.array(whole), atol=1e-3)


def test_row_extraction_reads_packed_layers_of_a_live_batch(qwen):
    layout = CacheLayout.from_model(qwen, Q8)
    live = layout.fresh(qwen)
    _prefill(qwen, live, np.arange(90) % 250, step=90)
    kv = rows.kv_rows(layout, live, None, 70, copy=True)
    assert set(kv.layers[1][0]) == set(quantized.PARTS) and kv.layers[1][0]["k_data"].shape[2] == 70
    assert rows.fed_lengths(layout, live, 0) == {90}


def test_composite_or_chunked_kv_under_kv_bits_is_refused_at_startup():
    from mlx_vlm.models.cache import CacheList, ChunkedKVCache

    class Composite:
        def make_cache(self):
            return [KVCache(), CacheList(KVCache(), KVCache())]

    class Chunked:
        def make_cache(self):
            return [ChunkedKVCache(8), KVCache(), KVCache()]

    for model in (Composite(), Chunked()):
        with pytest.raises(UnsupportedCacheError, match="--kv-bits"):
            CacheLayout.from_model(model, Q8)
        CacheLayout.from_model(model)  # float KV: served as before


def test_uniform_kv_bits_is_served_and_turboquant_refused_naming_the_options():
    assert kv_quant_of(["--model", "m", "--kv-bits", "8"], {}) == KVQuant(8, 64)
    assert kv_quant_of(["--kv-bits=4", "--kv-group-size", "32"], {}) == KVQuant(4, 32)
    assert kv_quant_of([], {"KV_BITS": "8.0", "KV_GROUP_SIZE": "128", "KV_QUANT_SCHEME": "uniform"}) \
        == KVQuant(8, 128)
    assert kv_quant_of([], {}) is None and kv_quant_of([], {"KV_BITS": "0"}) is None
    with pytest.raises(UnsupportedCacheError, match="TurboQuant.*integer --kv-bits.*APC_LINEAGE=0"):
        kv_quant_of(["--kv-bits", "3.5"], {})
    with pytest.raises(UnsupportedCacheError, match="TurboQuant"):
        kv_quant_of(["--kv-bits", "4", "--kv-quant-scheme", "turboquant"], {})
    assert check_options("8") == KVQuant(8, 64) and check_options(None) is None


class _Quantized:
    """The tiny model as the server runs it under ``--kv-bits``: cold caches are packed."""

    def __init__(self, lm, layout: CacheLayout) -> None:
        self.lm, self.layout = lm, layout

    def __call__(self, *args, **kwargs):
        return self.lm(*args, **kwargs)

    def make_cache(self):
        return self.layout.fresh(self.lm)


#: Families whose attention layers are plain KVCache, sized so mx.quantize can pack them (gpt_oss
#: is left out: mlx-vlm's quantized attention refuses its attention sinks, cold or warm).
QUANTIZABLE = {"qwen3_5": {"head_dim": 64, "full_attention_interval": 2}, "nemotron_h": {"head_dim": 64},
               "gemma3": {"head_dim": 64}}


@pytest.mark.parametrize("family", sorted(QUANTIZABLE))
def test_every_restore_kind_and_a_disk_restart_equal_cold_under_kv_bits(family, tmp_path):
    """The conformance script (tests/state/test_conformance_families.py) on packed layers: RAM
    entry, anchor, divergence and periodic restores, then disk files read by a new store."""
    from apcctl.lab.tinymodel.families import build_language_model
    from server_patch.disk.store import DiskStore
    from server_patch.lineage import LineageCache, LineageConfig
    from tests.state.test_conformance_families import ATOL, CONFIG, LONG, Driver, _tokens

    # The conformance file's 150-token script (periodic points at 64 and 128, anchor at 48): the
    # restores below sit on it.
    config, anchor_len = dict(CONFIG, periodic_stride=LONG.stride), LONG.anchor

    lm = build_language_model(family, overrides=QUANTIZABLE[family])
    layout = CacheLayout.from_model(lm, Q8)
    assert layout.packed, layout.describe()
    store = DiskStore(tmp_path, fingerprint="fp", layout=layout)
    drive = Driver(_Quantized(lm, layout), layout, LineageCache(LineageConfig(**config), disk=store))

    def check(prompt, kind, tier="ram", **kw):
        plan, warm, cold = drive.serve(prompt, **kw)
        assert (plan.kind, plan.tier or "ram") == (kind, tier), plan
        np.testing.assert_allclose(np.array(warm), np.array(cold), atol=ATOL, rtol=ATOL)

    first = _tokens(150, 1)
    check(first, "cold", anchor_len=anchor_len)
    second = np.concatenate([first, _tokens(30, 2)])
    check(second, "entry")
    check(np.concatenate([first[:140], _tokens(40, 4)]), "periodic")  # 128
    check(np.concatenate([first[:140], _tokens(40, 5)]), "divergence")  # 140: mid-group
    check(np.concatenate([first[:anchor_len], _tokens(60, 7)]), "anchor")

    drive.cache.flush()
    assert store.flush(timeout=60)
    restarted = DiskStore(tmp_path, fingerprint="fp", layout=layout)
    drive.cache = LineageCache(LineageConfig(**config), disk=restarted)
    check(np.concatenate([second, _tokens(20, 8)]), "entry", tier="disk")
    # A float server (another layout) never reads these files.
    assert not list(DiskStore(tmp_path, fingerprint="fp", layout=CacheLayout.from_model(lm)).records())
    store.close()
    restarted.close()
