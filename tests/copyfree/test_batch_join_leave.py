"""A row joining or leaving the decoding batch the copy-free way (``copyfree.batch``, issue 40)
gives what mlx-vlm's ``BatchKVCache.extend``/``filter`` give: the same write index, offsets and
left padding, the same rows over ``[:_idx]``, and the same logits from the tiny glm5_next
model's hybrid layout (KDA recurrent layers + sparse-MLA KV layers) through mixed joins and
leaves. In process: the test's mlx-vlm is pristine, so its methods are the stock reference.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.generate.ar import _extend_cache, _make_cache
from mlx_vlm.models.cache import BatchKVCache

from server_patch.copyfree import batch
from server_patch.copyfree.spares import JointSpares
from tests.fake_model import prefill, random_tokens


def _cache(rows: int, heads: int, width: int, idx: int, pads: list[int], dk: int, dv: int,
           dtype: Any, seed: int) -> BatchKVCache:
    rng = np.random.RandomState(seed)
    cache = BatchKVCache(pads)
    if width:
        keys = rng.normal(size=(rows, heads, width, dk))
        values = rng.normal(size=(rows, heads, width, dv))
        cache.keys = mx.array(keys > 0) if dtype == mx.bool_ else mx.array(keys).astype(dtype)
        cache.values = mx.array(values > 0) if dtype == mx.bool_ else mx.array(values).astype(dtype)
        cache._idx = idx
        cache.offset = cache.offset + idx
    return cache


def _same(stock: BatchKVCache, ours: BatchKVCache) -> None:
    assert ours._idx == stock._idx
    assert ours.offset.tolist() == stock.offset.tolist()
    assert ours.left_padding.tolist() == stock.left_padding.tolist()
    assert (ours.keys is None) == (stock.keys is None)
    if stock.keys is not None:
        n = stock._idx
        assert ours.keys.shape[:2] == stock.keys.shape[:2] and ours.keys.shape[2] >= n
        for a, b in ((ours.keys, stock.keys), (ours.values, stock.values)):
            assert np.array_equal(np.array(a[..., :n, :].astype(mx.float32)), np.array(b[..., :n, :].astype(mx.float32)))


# (rows, width, idx, pads) of the decoding batch and of the joining batch: a long row joins a
# short one, a short one a long one, equal write indices, a buffer with room past its index,
# one with none, and an empty joiner (a cache a sparse layer keeps but decode never fills).
JOINS = [
    ((1, 256, 20, [0]), (1, 512, 300, [0])),
    ((2, 512, 300, [0, 120]), (1, 256, 20, [3])),
    ((1, 256, 40, [5]), (2, 256, 40, [0, 7])),
    ((1, 300, 300, [0]), (1, 64, 10, [0])),
    ((1, 256, 20, [0]), (1, 0, 0, [0])),
]


@pytest.mark.parametrize("dtype, dk, dv", [(mx.bfloat16, 16, 16), (mx.float32, 16, 0), (mx.bool_, 1, 1)])
@pytest.mark.parametrize("mine, theirs", JOINS)
def test_join_gives_extends_rows_offsets_and_padding(dtype: Any, dk: int, dv: int, mine: tuple, theirs: tuple) -> None:
    def pair() -> tuple[BatchKVCache, BatchKVCache]:
        return (_cache(mine[0], 2, mine[1], mine[2], mine[3], dk, dv, dtype, 1),
                _cache(theirs[0], 2, theirs[1], theirs[2], theirs[3], dk, dv, dtype, 2))

    stock, other = pair()
    stock.extend(other)
    ours, other = pair()
    batch.extend_kv(ours, other)
    _same(stock, ours)
    # Stock concatenates an empty side as float32 (bf16 and bool rows turn float32); ours keeps
    # the rows' own dtype.
    assert ours.keys.dtype == dtype and ours.values.dtype == dtype
    assert ours.keys.shape[2] > ours._idx  # room for the next decode step: no regrow


def test_join_of_two_empty_batches_joins_their_padding() -> None:
    stock, ours = BatchKVCache([1, 2]), BatchKVCache([1, 2])
    stock.extend(BatchKVCache([3]))
    batch.extend_kv(ours, BatchKVCache([3]))
    _same(stock, ours)


@pytest.mark.parametrize("keep", [[0], [1], [2], [0, 1], [1, 2], [0, 2], [2, 0], [0, 1, 2]])
def test_leave_gives_filters_rows_offsets_and_padding(keep: list[int]) -> None:
    def three() -> BatchKVCache:
        return _cache(3, 2, 512, 300, [280, 0, 150], 16, 16, mx.bfloat16, 3)

    stock, ours = three(), three()
    stock.filter(mx.array(keep, mx.int32))
    batch.filter_kv(ours, mx.array(keep, mx.int32))
    _same(stock, ours)
    token = mx.ones((len(keep), 2, 1, 16), mx.bfloat16)
    for a, b in zip(stock.update_and_fetch(token, token), ours.update_and_fetch(token, token)):
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))


def test_leave_keeps_only_the_columns_a_kept_row_uses() -> None:
    # The long row leaves: the short row is kept from its first token on, not at the joint width.
    cache = _cache(2, 2, 4352, 4100, [4000, 0], 16, 16, mx.bfloat16, 4)
    batch.filter_kv(cache, mx.array([0], mx.int32))
    assert cache._idx == 100 and cache.left_padding.tolist() == [0]
    assert cache.keys.shape == (1, 2, 4352 - 4000, 16)


def test_contiguous_range_is_told_apart_from_a_gather() -> None:
    assert batch.contiguous_range([1, 2, 3]) == (1, 4)
    assert batch.contiguous_range([0, 2]) is None
    assert batch.contiguous_range([2, 1]) is None
    assert batch.contiguous_range([]) is None


# --- the hybrid model: logits through joins and leaves ------------------------------------

def _rows_cache(model: Any, tokens: np.ndarray) -> tuple[list[Any], int]:
    """A one-row batch cache of the model holding ``tokens``, and its next token."""
    cache = _make_cache(model, [0])
    logits = prefill(model, cache, tokens)
    return cache, int(mx.argmax(logits, axis=-1).item())


def _decode(model: Any, cache: list[Any], tokens: list[int], steps: int, seen: list[np.ndarray]) -> list[int]:
    for _ in range(steps):
        logits = model(mx.array(tokens)[:, None], cache=cache).logits[:, -1]
        mx.eval(logits)
        seen.append(np.array(logits.astype(mx.float32)))
        tokens = [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
    return tokens


def _leave(cache: list[Any], keep: list[int]) -> None:
    index = mx.array(keep, mx.int32)
    for c in cache:
        c.filter(index)


def _story(model: Any) -> list[np.ndarray]:
    """A 20-token stream decodes; a 150-token turn joins it; a 40-token one joins them; the
    middle row leaves (a gather); the first leaves (a contiguous range); each step's logits."""
    seen: list[np.ndarray] = []
    cache, a = _rows_cache(model, random_tokens(20, seed=5))
    [a] = _decode(model, cache, [a], 2, seen)
    joining, b = _rows_cache(model, random_tokens(150, seed=6))
    cache = _extend_cache(cache, joining)
    a, b = _decode(model, cache, [a, b], 3, seen)
    third, c = _rows_cache(model, random_tokens(40, seed=7))
    cache = _extend_cache(cache, third)
    a, b, c = _decode(model, cache, [a, b, c], 2, seen)
    _leave(cache, [0, 2])
    a, c = _decode(model, cache, [a, c], 2, seen)
    _leave(cache, [1])
    _decode(model, cache, [c], 2, seen)
    return seen


def _copyfree(patch: pytest.MonkeyPatch) -> None:
    """What the overlay's edits of models/cache.py do with ``APC_COPYFREE`` on."""
    extend: Callable[..., None] = batch.extend_kv
    keep: Callable[..., None] = batch.filter_kv
    patch.setattr(BatchKVCache, "extend", lambda self, other: extend(self, other))
    patch.setattr(BatchKVCache, "filter", lambda self, index: keep(self, index))


def test_hybrid_model_logits_equal_through_joins_and_leaves(model: Any) -> None:
    from mlx_vlm.models.cache import ArraysCache, CacheList

    probe = _make_cache(model, [0])
    assert any(type(c) is ArraysCache for c in probe) and any(type(c) is CacheList for c in probe)
    stock = _story(model)
    with pytest.MonkeyPatch.context() as patch:
        _copyfree(patch)
        ours = _story(model)
    assert len(ours) == len(stock) == 11
    for step, (a, b) in enumerate(zip(stock, ours)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"decode step {step}")


# --- a joint buffer made ahead (a staged turn's join) ---------------------------------------

def test_a_join_takes_the_zero_buffer_made_ahead_for_its_shape_and_gives_the_same_rows() -> None:
    def pair() -> tuple[BatchKVCache, BatchKVCache]:
        return (_cache(1, 2, 256, 20, [0], 16, 16, mx.bfloat16, 1),
                _cache(1, 2, 768, 300, [0], 16, 16, mx.bfloat16, 2))

    stock, other = pair()
    stock.extend(other)
    ours, other = pair()
    spares = JointSpares()
    spares.reserve([other.keys, other.values])
    assert spares.count() == 2
    batch.extend_kv(ours, other, spares)
    assert spares.count() == 0  # both taken: the join wrote into them
    _same(stock, ours)
    assert ours.keys.shape == (2, 2, 768, 16)


def test_a_join_of_another_shape_leaves_the_buffer_made_ahead_alone() -> None:
    three, other = _cache(2, 2, 256, 20, [0, 5], 16, 16, mx.bfloat16, 1), _cache(1, 2, 768, 300, [0], 16, 16, mx.bfloat16, 2)
    short = (_cache(1, 2, 256, 20, [0], 16, 16, mx.bfloat16, 3), _cache(1, 2, 256, 30, [0], 16, 16, mx.bfloat16, 4))
    spares = JointSpares()
    spares.reserve([other.keys, other.values])  # for a 2-row joint batch, 768 wide
    batch.extend_kv(three, other, spares)  # 3 rows
    batch.extend_kv(*short, spares)  # 2 rows, but 286 wide: the staged turn's buffer is kept for it
    assert spares.drop() == 2
    assert three.keys.shape[0] == 3 and short[0].keys.shape[2] == 286


def test_a_runtimes_idle_drop_takes_buffers_no_join_took_once_the_pool_is_idle() -> None:
    from server_patch.copyfree import pool
    from server_patch.copyfree.settings import CopyFreeSettings

    row = _cache(1, 2, 768, 300, [0], 16, 16, mx.bfloat16, 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pool, "_settings", CopyFreeSettings(pool_idle_s=1.0))
        patch.setattr(pool, "_last_activity", 1.0)  # prefill work at 1 s, none since
        patch.setattr(pool, "_released_at", 0.0)
        spares = JointSpares()
        spares.reserve([row.keys, row.values])
        assert spares.drop_if_idle(now=1.5) == 0 and spares.count() == 2  # busy 0.5 s ago: kept
        assert spares.drop_if_idle(now=10.0) == 2  # idle for 9 s of a 1 s limit
    assert spares.count() == 0
