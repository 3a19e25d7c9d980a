"""Copy-free pieces in isolation: the capacity merge, row views vs copies, settings, the pool."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.apc import make_warm_batch_exact_cache_multi
from mlx_vlm.models.cache import BatchKVCache, KVCache

from tests.fake_model import prefill, random_tokens as tokens
from server_patch.copyfree import pool
from server_patch.copyfree.counter import _address
from server_patch.copyfree.merge import capacity, merge_kv, merge_rows
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.state import rows


def kv_row(n: int, seed: int, heads: int = 1, dim: int = 8) -> KVCache:
    cache = KVCache()
    rng = np.random.RandomState(seed)
    cache.update_and_fetch(mx.array(rng.randn(1, heads, n, dim).astype(np.float32)),
                           mx.array(rng.randn(1, heads, n, dim).astype(np.float32)))
    return cache


def test_capacity_rounds_to_buckets_of_a_sixteenth():
    assert capacity(1) == 256 and capacity(256) == 256 and capacity(257) == 512
    assert capacity(8191) == 8192 and capacity(8193) == 8704  # 512-row buckets from 8k
    assert capacity(16_700) == 17_408  # 1024-row buckets from 16k
    for needed in (300, 5_000, 20_000, 100_000):
        assert needed <= capacity(needed) <= needed * 1.07 + 256


@pytest.mark.parametrize("lengths", [(40,), (40, 25), (0, 31)])
def test_merge_matches_stock_layout_and_leaves_room(lengths):
    row_caches = [kv_row(n, seed=i) if n else KVCache() for i, n in enumerate(lengths)]
    stock = BatchKVCache.merge(row_caches)
    ours = merge_kv(row_caches, capacity(max(lengths) + 300))
    assert ours.keys.shape[2] >= max(lengths) + 300 > stock.keys.shape[2] == max(lengths)
    assert ours._idx == stock._idx
    assert np.array_equal(np.array(ours.offset), np.array(stock.offset))
    assert np.array_equal(np.array(ours.left_padding), np.array(stock.left_padding))
    assert np.array_equal(np.array(ours.state[0]), np.array(stock.state[0]))

    # A suffix lands in the spare rows: same buffer, same result as stock's regrown cache.
    new = mx.array(np.random.RandomState(9).randn(len(lengths), 1, 20, 8).astype(np.float32))
    mx.eval(ours.keys)
    before = (ours.keys.shape, _address(ours.keys))
    got_k, _ = ours.update_and_fetch(new, new)
    want_k, _ = stock.update_and_fetch(new, new)
    mx.eval(ours.keys)
    assert (ours.keys.shape, _address(ours.keys)) == before, "the suffix regrew or copied the buffer"
    assert np.array_equal(np.array(got_k), np.array(want_k))


def test_restored_rows_merge_to_the_same_logits_as_stock(model, layout):
    prompt = tokens(230, seed=3)
    live = model.make_cache()
    prefill(model, live, prompt[:150], step=50)
    kv, snap = layout.split(live, 150)

    stock, _ = make_warm_batch_exact_cache_multi([layout.build(kv, snap, 150)], [150])
    ours = merge_rows([layout.build(kv, snap, 150)], [150], [80], reserve=256)
    want = prefill(model, stock, prompt[150:], step=80)
    got = prefill(model, ours, prompt[150:], step=80)
    assert np.array_equal(np.array(got), np.array(want))


def test_row_views_share_the_buffer_and_copies_do_not(model, layout):
    live = model.make_cache()
    prefill(model, live, tokens(90, seed=4), step=90)
    batch = merge_rows([live], [90], [10], reserve=0)  # a one-row batch cache, as a server has
    latent = batch[2].caches[0]
    views = rows.kv_rows(layout, batch, 0, 90, copy=False)
    copies = rows.kv_rows(layout, batch, 0, 90, copy=True)
    base = _address(latent.keys)
    assert _address(views.layers[2][0]["keys"]) == base
    assert _address(copies.layers[2][0]["keys"]) != base
    assert views.nbytes == copies.nbytes
    # A lone row keeps its whole buffer (the room a later turn is lent); the state is the
    # first 90 rows, which is all a disk file gets.
    assert views.layers[2][0]["keys"].shape[2] == latent.keys.shape[2] > 90
    assert views.capacity() == latent.keys.shape[2] and copies.capacity() == 90
    trimmed = [v for layer in views.trimmed_layers() for child in layer for k, v in child.items()
               if isinstance(v, mx.array)]
    for a, b in zip(trimmed, copies.arrays()):
        assert np.array_equal(np.array(a), np.array(b))
    assert rows.batch_size(batch) == 1 and rows.buffer_rows(batch) == latent.keys.shape[2]


def test_settings_from_env_and_adoption_limit():
    s = CopyFreeSettings.from_env({"APC_POOL_CLEAR": "1", "APC_POOL_LIMIT_GB": "2.5",
                                   "APC_COPYFREE_ADOPT": "off", "APC_POOL_IDLE_S": "0"})
    assert s.pool_clear and s.pool_limit_gb == 2.5 and not s.adopt and s.pool_idle_s == 0
    assert CopyFreeSettings.from_env({}) == CopyFreeSettings()
    with pytest.raises(ValueError, match="APC_POOL_CLEAR"):
        CopyFreeSettings.from_env({"APC_POOL_CLEAR": "maybe"})
    # Loans need adopted buffers: off with APC_COPYFREE_LEND=0, APC_COPYFREE_ADOPT=0 or APC_COPYFREE=0.
    assert s.lend and not s.lending and CopyFreeSettings().lending
    assert not CopyFreeSettings.from_env({"APC_COPYFREE_LEND": "0"}).lending
    assert not CopyFreeSettings.from_env({"APC_COPYFREE": "0"}).lending
    assert CopyFreeSettings.from_env({"APC_COPYFREE_LEND_HEADROOM": "2048"}).lend_headroom == 2048
    with pytest.raises(ValueError, match=">= 0"):
        CopyFreeSettings.from_env({"APC_COPYFREE_LEND_HEADROOM": "-1"})
    d = CopyFreeSettings()
    assert d.adoptable(16_000, 16_000 + 2_048) and not d.adoptable(1_000, 1_000 + 2_049)
    assert d.adoptable(40_000, 50_000) and not d.adoptable(40_000, 50_001)


def _pooled_bytes_after_clear(site: str) -> int:
    big = mx.zeros((64, 1024, 1024), dtype=mx.uint8)  # 64 MB, freed into the pool below
    mx.eval(big)
    del big
    assert mx.get_cache_memory() >= 64 << 20
    pool.clear(site)
    return mx.get_cache_memory()


def test_pool_clear_is_opt_in_and_the_pool_is_bounded():
    try:
        pool.reconfigure(CopyFreeSettings(pool_limit_gb=1.0, pool_idle_s=0))
        assert mx.set_cache_limit(1 << 30) == 1 << 30  # the limit was applied
        assert _pooled_bytes_after_clear("prefill_chunk") >= 64 << 20  # kept for reuse
        assert pool.stats()["skipped"]["prefill_chunk"] >= 1

        pool.reconfigure(CopyFreeSettings(pool_clear=True, pool_limit_gb=1.0, pool_idle_s=0))
        assert _pooled_bytes_after_clear("prompt_batch") == 0  # APC_POOL_CLEAR=1: stock behaviour
        assert pool.stats()["cleared"]["prompt_batch"] >= 1
    finally:
        pool.reconfigure(CopyFreeSettings(pool_idle_s=0))


def test_idle_release_waits_for_a_quiet_period():
    try:
        pool.reconfigure(CopyFreeSettings(pool_idle_s=30))
        big = mx.zeros((16, 1024, 1024), dtype=mx.uint8)
        mx.eval(big)
        del big
        pool.touch()
        now = time.monotonic()
        assert not pool.release_if_idle(now + 5)
        assert mx.get_cache_memory() > 0
        assert pool.release_if_idle(now + 31)
        assert mx.get_cache_memory() == 0
        assert not pool.release_if_idle(now + 62)  # once per quiet period
    finally:
        pool.reconfigure(CopyFreeSettings(pool_idle_s=0))
