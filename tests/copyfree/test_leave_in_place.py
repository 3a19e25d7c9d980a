"""A leave that keeps the rows that stay where they are (``copyfree.batch``, issue 40).

When the rows kept fill at least half the batch buffer (a long row that stays when a short one
leaves), ``filter_kv`` copies nothing: the cache shows views of the old buffer and ``write_kv``
(the patched ``update_and_fetch``) writes each next token into that buffer in place. Checked
against mlx-vlm's own ``filter`` and ``update_and_fetch`` (the test's mlx-vlm is pristine): the
same rows, offsets, padding and write index after every step, through a regrow, a second leave
and a join; no buffer allocated by the leave or its writes (MLX's active memory); a commit that
reads such rows copies them rather than pin the rows that left; the hybrid model's logits.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.cache import BatchKVCache

from server_patch.copyfree import batch
from server_patch.copyfree.counter import _address
from server_patch.state.row_view import live_view
from tests.copyfree.test_batch_join_leave import _cache, _same


def _write(cache: BatchKVCache, token: mx.array) -> tuple[mx.array, mx.array]:
    """One decode step's write, as the patched ``update_and_fetch`` does it."""
    fetched = batch.write_kv(cache, token, token)
    return fetched if fetched is not None else cache.update_and_fetch(token, token)


def _steps(stock: BatchKVCache, ours: BatchKVCache, rows: int, count: int, seed: int) -> None:
    """``count`` decode writes into both caches: the same fetched rows after each."""
    rng = np.random.RandomState(seed)
    for _ in range(count):
        token = mx.array(rng.normal(size=(rows, 2, 1, 16))).astype(mx.bfloat16)
        for a, b in zip(stock.update_and_fetch(token, token), _write(ours, token)):
            assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
    _same(stock, ours)


def _two() -> BatchKVCache:
    # A 100-token short row and a 1,000-token long row, right-aligned in a 1,024-wide buffer.
    return _cache(2, 2, 1024, 1000, [900, 0], 16, 16, mx.bfloat16, 11)


def test_the_long_row_stays_in_place_and_answers_as_mlx_vlms_filter_through_a_regrow() -> None:
    stock, ours = _two(), _two()
    stock.filter(mx.array([1], mx.int32))
    batch.filter_kv(ours, mx.array([1], mx.int32))
    view = live_view(ours)
    assert view is not None and (view.first, view.end, view.column) == (1, 2, 0)
    _same(stock, ours)
    _steps(stock, ours, 1, 20, seed=1)  # 1,000 -> 1,020 of 1,024: written in place
    assert live_view(ours) is view
    _steps(stock, ours, 1, 10, seed=2)  # past 1,024: mlx-vlm's regrow, into a buffer of its own
    assert live_view(ours) is None and ours.keys.shape[0] == 1


def test_the_leave_and_its_writes_allocate_nothing() -> None:
    cache = _two()
    mx.eval(cache.keys, cache.values)
    kept_bytes = (int(cache.keys.nbytes) + int(cache.values.nbytes)) // 2
    token = mx.ones((1, 2, 1, 16), mx.bfloat16)
    mx.eval(token)
    base = _address(cache.keys)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    batch.filter_kv(cache, mx.array([1], mx.int32))
    for _ in range(5):
        mx.eval(*_write(cache, token))
    grown = mx.get_peak_memory() - before
    assert grown < kept_bytes // 4, f"{grown} bytes allocated: the kept row ({kept_bytes} bytes) was copied"
    # Still the old buffer, written in place: the kept row 1 of 2 starts half way into it.
    assert base is not None and _address(cache.keys) == base + int(cache.keys.nbytes)
    # The same leave copied (the short row kept, or ``leave="copy"``) allocates the kept rows.
    copied = _two()
    mx.eval(copied.keys, copied.values)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    batch.filter_kv(copied, mx.array([1], mx.int32), leave="copy")
    mx.eval(copied.keys, copied.values)
    assert mx.get_peak_memory() - before >= kept_bytes // 2 and live_view(copied) is None


def test_a_short_row_that_stays_is_copied_at_its_width_not_kept_with_the_long_rows_buffer() -> None:
    stock, ours = _two(), _two()
    stock.filter(mx.array([0], mx.int32))
    batch.filter_kv(ours, mx.array([0], mx.int32))
    assert live_view(ours) is None  # 100 of 2 x 1,024 columns: the joint buffer is let go
    assert ours.keys.shape == (1, 2, 1024 - 900, 16)
    _same(stock, ours)


@pytest.mark.parametrize("second, in_place", [([0, 1], True), ([1, 2], False)])
def test_a_second_leave_narrows_the_same_buffer_while_the_rows_kept_fill_half_of_it(
        second: list[int], in_place: bool) -> None:
    def four() -> BatchKVCache:
        # 1,000-, 900-, 800- and 50-token rows in a 1,024-wide buffer: the short one leaves first.
        return _cache(4, 2, 1024, 1000, [0, 100, 200, 950], 16, 16, mx.bfloat16, 12)

    stock, ours = four(), four()
    stock.filter(mx.array([0, 1, 2], mx.int32))
    batch.filter_kv(ours, mx.array([0, 1, 2], mx.int32))
    first = live_view(ours)
    assert first is not None and (first.first, first.end, first.column) == (0, 3, 0)
    _steps(stock, ours, 3, 3, seed=3)
    stock.filter(mx.array(second, mx.int32))
    batch.filter_kv(ours, mx.array(second, mx.int32))
    view = live_view(ours)
    if in_place:  # 2 rows x all 1,024 columns of 4 x 1,024: half, kept in the same buffer
        assert view is first and (view.first, view.end, view.column) == (0, 2, 0)
    else:  # 2 rows x 924 columns (100 dropped) of 4 x 1,024: under half, copied out
        assert view is None and ours.keys.shape == (2, 2, 1024 - 100, 16)
    _same(stock, ours)
    _steps(stock, ours, 2, 3, seed=4)


def test_a_join_or_a_buffer_set_by_mlx_vlm_drops_the_record_and_the_old_buffer() -> None:
    ours = _two()
    batch.filter_kv(ours, mx.array([1], mx.int32))
    joiner = _cache(1, 2, 256, 30, [0], 16, 16, mx.bfloat16, 13)
    stock = _two()
    stock.filter(mx.array([1], mx.int32))
    stock.extend(_cache(1, 2, 256, 30, [0], 16, 16, mx.bfloat16, 13))
    batch.extend_kv(ours, joiner)
    assert live_view(ours) is None
    _same(stock, ours)
    _steps(stock, ours, 2, 2, seed=5)

    again = _two()
    batch.filter_kv(again, mx.array([1], mx.int32))
    again.keys = mx.array(again.keys)  # e.g. ``finalize``'s roll: mlx-vlm set buffers of its own
    token = mx.ones((1, 2, 1, 16), mx.bfloat16)
    assert batch.write_kv(again, token, token) is None and live_view(again) is None


def test_a_commit_copies_rows_kept_in_place_instead_of_pinning_the_old_buffer() -> None:
    from server_patch.state import rows

    cache = _two()
    batch.filter_kv(cache, mx.array([1], mx.int32))
    mx.eval(cache.keys)
    view = live_view(cache)
    assert view is not None
    low = _address(view.keys)
    high = low + int(view.keys.nbytes)
    row = rows._kv_row(cache, 0, 1000, copy=False)  # what adopting a lone row's buffer reads
    mx.eval(row.keys)
    assert not low <= _address(row.keys) < high, "the entry would pin the rows that left"
    assert np.array_equal(np.array(row.keys.astype(mx.float32)),
                          np.array(cache.keys[..., :1000, :].astype(mx.float32)))


def test_hybrid_model_logits_equal_with_leaves_kept_in_place(model: Any) -> None:
    from tests.copyfree.test_batch_join_leave import _copyfree, _story

    stock = _story(model)
    wrote = []
    stock_update = BatchKVCache.update_and_fetch

    def update(self: BatchKVCache, keys: mx.array, values: mx.array) -> Any:
        fetched = batch.write_kv(self, keys, values)
        wrote.append(fetched is not None)
        return fetched if fetched is not None else stock_update(self, keys, values)

    with pytest.MonkeyPatch.context() as patch:
        _copyfree(patch)
        patch.setattr(BatchKVCache, "update_and_fetch", update)
        ours = _story(model)
    assert any(wrote), "no leave of the story kept its rows in place"
    assert len(ours) == len(stock)
    for step, (a, b) in enumerate(zip(stock, ours)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"decode step {step}")


# --- a join into the rows a leave freed ---------------------------------------------------------

def _visited(seed: int) -> BatchKVCache:
    """A 1,000-token row in a 1,024-wide buffer, then a 30-token request joined (mlx-vlm's extend
    or ``extend_kv``: a new 2-row buffer, the long row first)."""
    return _cache(1, 2, 1024, 1000, [0], 16, 16, mx.bfloat16, seed)


def _visitor(seed: int) -> BatchKVCache:
    return _cache(1, 2, 256, 30, [0], 16, 16, mx.bfloat16, seed)


def test_a_short_request_joins_into_the_row_a_leave_freed_and_nothing_else_moves() -> None:
    stock, ours = _visited(14), _visited(14)
    stock.extend(_visitor(15))
    batch.extend_kv(ours, _visitor(15))  # the first visit: the long row copied once, into a new buffer
    _steps(stock, ours, 2, 3, seed=6)
    stock.filter(mx.array([0], mx.int32))
    batch.filter_kv(ours, mx.array([0], mx.int32))
    view = live_view(ours)
    # The visitor's row is free, written from column 970 on (1,000 - 30, where its join put it).
    assert view is not None and (view.first, view.end) == (0, 1) and view.dirty == {1: 970}
    _steps(stock, ours, 1, 4, seed=7)
    mx.eval(ours.keys, ours.values)
    base, row_bytes = _address(view.keys), int(view.keys.nbytes) // 2
    for visit, seed in enumerate((16, 17)):
        joiner = _visitor(seed)
        mx.eval(joiner.keys, joiner.values)
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        batch.extend_kv(ours, joiner)
        mx.eval(ours.keys, ours.values)
        grown = mx.get_peak_memory() - before
        assert grown < row_bytes // 4, f"visit {visit}: {grown} bytes allocated: the long row was copied"
        assert live_view(ours) is view and (view.first, view.end) == (0, 2) and _address(view.keys) == base
        stock.extend(_visitor(seed))
        _same(stock, ours)  # the free row's old columns zeroed: as mlx-vlm's extend pads
        _steps(stock, ours, 2, 3, seed=seed)
        stock.filter(mx.array([0], mx.int32))  # the visitor leaves; the long row stays in place
        batch.filter_kv(ours, mx.array([0], mx.int32))
        assert live_view(ours) is view and (view.first, view.end) == (0, 1) and 1 in view.dirty
        _same(stock, ours)


def test_a_joiner_wider_than_the_rows_kept_joins_into_a_new_buffer() -> None:
    ours = _visited(18)
    batch.extend_kv(ours, _visitor(19))
    batch.filter_kv(ours, mx.array([0], mx.int32))
    assert live_view(ours) is not None
    batch.extend_kv(ours, _cache(1, 2, 2048, 1500, [0], 16, 16, mx.bfloat16, 17))
    assert live_view(ours) is None and ours.keys.shape[0] == 2 and ours._idx == 1500


def test_hybrid_model_logits_equal_with_visits_joining_freed_rows(model: Any) -> None:
    from tests.copyfree.test_batch_join_leave import _copyfree, _decode, _extend_cache, _leave, _rows_cache
    from tests.fake_model import random_tokens

    def visits() -> list[np.ndarray]:
        """A 150-token stream decodes; two 20-token requests join it and leave, one after another."""
        seen: list[np.ndarray] = []
        cache, a = _rows_cache(model, random_tokens(150, seed=8))
        [a] = _decode(model, cache, [a], 2, seen)
        for seed in (9, 10):
            visitor, v = _rows_cache(model, random_tokens(20, seed=seed))
            cache = _extend_cache(cache, visitor)
            a, v = _decode(model, cache, [a, v], 2, seen)
            _leave(cache, [0])
            [a] = _decode(model, cache, [a], 2, seen)
        return seen

    stock = visits()
    into_free: list[bool] = []
    free_rows, stock_update = batch._into_free_rows, BatchKVCache.update_and_fetch

    def noted(cache: Any, other: Any) -> bool:
        into_free.append(free_rows(cache, other))
        return into_free[-1]

    def update(self: BatchKVCache, keys: mx.array, values: mx.array) -> Any:
        fetched = batch.write_kv(self, keys, values)
        return fetched if fetched is not None else stock_update(self, keys, values)

    with pytest.MonkeyPatch.context() as patch:
        _copyfree(patch)
        patch.setattr(batch, "_into_free_rows", noted)
        patch.setattr(BatchKVCache, "update_and_fetch", update)
        ours = visits()
    assert True in into_free, "the second visit did not join into the row the first one freed"
    assert len(ours) == len(stock)
    for step, (a, b) in enumerate(zip(stock, ours)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"decode step {step}")
