"""A decoding batch outgrowing its KV buffer grows into buffers made ahead (``copyfree.grow``,
``integration.grows_ahead``, issue 40).

Checked against mlx-vlm's own ``update_and_fetch`` (the test's mlx-vlm is pristine): the same
fetched rows, offsets, padding and write index at every step through two regrows; the regrow
writes into the buffers the stager made (their addresses) and allocates nothing of the batch's
size; ``tend`` asks once when the regrow is near and lets an untaken set go once it has passed;
rows that left meanwhile make the regrow allocate, as mlx-vlm does; the hybrid model's logits.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Iterator

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.cache import BatchKVCache

from server_patch.copyfree import grow
from server_patch.copyfree.counter import _address
from server_patch.copyfree.spares import JointSpares
from server_patch.disk.loader import BackgroundLoads
from server_patch.integration import grows_ahead
from tests.copyfree.test_batch_join_leave import _cache, _rows_cache, _same
from tests.fake_model import random_tokens


class _Stager:
    """The runtime's stager: jobs run on a thread of their own, waited for by ``settle``."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-stager")
        self.jobs: list[Future[Any]] = []
        self.loads = BackgroundLoads(submit=self._submit)

    def _submit(self, job: Any, *args: Any) -> Future[Any]:
        self.jobs.append(self._thread.submit(job, *args))
        return self.jobs[-1]

    def settle(self) -> list[Any]:
        return [job.result(timeout=120) for job in self.jobs]


@pytest.fixture
def stager() -> Iterator[_Stager]:
    made = _Stager()
    yield made
    made._thread.shutdown()


def _runtime(stager: _Stager) -> SimpleNamespace:
    return SimpleNamespace(grow_spares=JointSpares(), stages=stager.loads)


class _Batch:
    """What ``grows_ahead.tend`` reads of mlx-vlm's ``GenerationBatch``."""

    def __init__(self, caches: list[Any], rows: int) -> None:
        self.prompt_cache = caches
        self.uids = list(range(rows))


def _batch(caches: list[Any]) -> _Batch:
    return _Batch(caches, int(caches[0].keys.shape[0]))


def _tend(runtime: SimpleNamespace, decoding: _Batch, stager: _Stager) -> set[int]:
    """The door's decode step, before its forward: the regrow's buffers asked when it is near,
    the stager's job finished (here: waited for). The addresses of the buffers held."""
    grows_ahead.tend(runtime, decoding)  # type: ignore[arg-type]
    assert all(stager.settle())
    return {a for a in (_address(s) for s in runtime.grow_spares._spares) if a is not None}


def _write(runtime: SimpleNamespace, decoding: _Batch, token: mx.array) -> list[tuple[mx.array, mx.array]]:
    """The step's writes into every layer, as the patched ``update_and_fetch`` does them."""
    fetched = []
    for cache in decoding.prompt_cache:
        grown = grow.grow_kv(cache, token, token, runtime.grow_spares)
        fetched.append(grown if grown is not None else cache.update_and_fetch(token, token))
    return fetched


def _step(runtime: SimpleNamespace, decoding: _Batch, token: mx.array,
          stager: _Stager) -> list[tuple[mx.array, mx.array]]:
    _tend(runtime, decoding, stager)
    return _write(runtime, decoding, token)


def _two_rows(seed: int) -> list[BatchKVCache]:
    # Two layers; rows of 100 and 1,000 tokens right-aligned in a 1,024-wide buffer: the 25th
    # decode write regrows it.
    return [_cache(2, 2, 1024, 1000, [900, 0], 16, 16, mx.bfloat16, seed + i) for i in range(2)]


def test_the_regrow_writes_into_the_buffers_made_ahead_and_answers_as_mlx_vlm(stager: _Stager) -> None:
    stock, ours = _two_rows(3), _two_rows(3)
    runtime, decoding = _runtime(stager), _batch(ours)
    rng = np.random.RandomState(4)
    for step in range(24 + 256 + 8):  # through two regrows: at 1,024 and at 1,280 columns
        token = mx.array(rng.normal(size=(2, 2, 1, 16))).astype(mx.bfloat16)
        made_at = _tend(runtime, decoding, stager)
        wanted = [c.keys for c in ours]
        fetched = _write(runtime, decoding, token)
        for cache, (keys, values) in zip(stock, fetched):
            for a, b in zip(cache.update_and_fetch(token, token), (keys, values)):
                assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
        if any(c.keys is not w for c, w in zip(ours, wanted)):  # this step grew the buffers
            assert step in (24, 24 + 256)
            assert made_at and {_address(c.keys) for c in ours} <= made_at, "grew into fresh memory"
            assert runtime.grow_spares.count() == 0  # every buffer made ahead was taken
    for a, b in zip(stock, ours):
        _same(a, b)
    assert len(stager.jobs) == 2  # asked once per regrow, AHEAD_STEPS before it


def test_the_regrow_into_buffers_made_ahead_allocates_nothing_of_the_batchs_size(stager: _Stager) -> None:
    ours = _two_rows(5)
    runtime, decoding = _runtime(stager), _batch(ours)
    token = mx.ones((2, 2, 1, 16), mx.bfloat16)
    mx.eval(token, *[c.keys for c in ours], *[c.values for c in ours])
    for _ in range(24):  # 1,024 of 1,024: the next write regrows
        mx.eval(*[t for kv in _step(runtime, decoding, token, stager) for t in kv])
    assert runtime.grow_spares.count() == 4
    layer_bytes = int(ours[0].keys.nbytes) + int(ours[0].values.nbytes)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(*[t for kv in _write(runtime, decoding, token) for t in kv])
    allocated = mx.get_peak_memory() - before
    assert ours[0].keys.shape[2] == 1024 + 256
    assert allocated < layer_bytes // 4, f"{allocated} bytes allocated at the regrow"


def test_a_leave_before_the_regrow_lets_it_allocate_and_the_unused_set_go(stager: _Stager) -> None:
    stock, ours = _two_rows(7), _two_rows(7)
    runtime, decoding = _runtime(stager), _batch(ours)
    token = mx.ones((2, 2, 1, 16), mx.bfloat16)
    for _ in range(24):
        for cache, fetched in zip(stock, _step(runtime, decoding, token, stager)):
            cache.update_and_fetch(token, token)
    assert runtime.grow_spares.count() == 4
    for cache in (*stock, *ours):  # the short row leaves (mlx-vlm's filter: copied, one row)
        cache.filter(mx.array([1], mx.int32))
    decoding.uids = [0]
    one = mx.ones((1, 2, 1, 16), mx.bfloat16)
    for _ in range(3):  # the regrow: no two-row buffer fits a one-row batch
        for cache, fetched in zip(stock, _step(runtime, decoding, one, stager)):
            cache.update_and_fetch(one, one)
    assert runtime.grow_spares.count() == 0  # let go by ``tend`` once the batch had room again
    for a, b in zip(stock, ours):
        _same(a, b)


def test_nothing_is_asked_while_the_batch_has_room(stager: _Stager) -> None:
    ours = [_cache(1, 2, 1024, 100, [0], 16, 16, mx.float32, 9)]
    runtime = _runtime(stager)
    assert not grows_ahead.tend(runtime, _batch(ours))  # type: ignore[arg-type]
    assert stager.jobs == [] and runtime.grow_spares.count() == 0


def test_hybrid_model_logits_equal_through_regrows(model: Any, stager: _Stager) -> None:
    tokens = random_tokens(240, seed=12)
    stock, first = _rows_cache(model, tokens)
    ours, _ = _rows_cache(model, tokens)
    runtime, decoding = _runtime(stager), _Batch(ours, 1)
    grown_before = [c.keys.shape[2] for c in grow.grown(ours)]
    assert grown_before and max(grown_before) - 240 < 40  # its sparse-MLA layers regrow within 40 steps

    def patched(self: BatchKVCache, keys: mx.array, values: mx.array) -> Any:
        done = grow.grow_kv(self, keys, values, runtime.grow_spares) if type(self) is BatchKVCache else None
        return done if done is not None else stock_write(self, keys, values)

    stock_write = BatchKVCache.update_and_fetch
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    a = b = [first]
    with pytest.MonkeyPatch.context() as patch:
        for _ in range(40):
            logits_stock = model(mx.array(a)[:, None], cache=stock).logits[:, -1]
            _tend(runtime, decoding, stager)
            patch.setattr(BatchKVCache, "update_and_fetch", patched)
            logits_ours = model(mx.array(b)[:, None], cache=ours).logits[:, -1]
            mx.eval(logits_ours)
            patch.undo()
            mx.eval(logits_stock)
            seen.append((np.array(logits_stock.astype(mx.float32)), np.array(logits_ours.astype(mx.float32))))
            a = b = [int(mx.argmax(logits_stock, axis=-1).item())]
    assert [c.keys.shape[2] for c in grow.grown(ours)] != grown_before  # it did regrow
    assert len(stager.jobs) >= 1
    for x, y in seen:
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_apc_copyfree_grow_0_leaves_the_regrow_to_mlx_vlm(stager: _Stager, monkeypatch: pytest.MonkeyPatch) -> None:
    from server_patch.copyfree import pool, spares
    from server_patch.copyfree.settings import CopyFreeSettings
    from server_patch.integration import hooks

    monkeypatch.setattr(pool, "_settings", CopyFreeSettings(grow=False))
    ours = _two_rows(21)
    runtime = _runtime(stager)
    for _ in range(24):  # full: the next write regrows
        for cache in ours:
            cache.update_and_fetch(mx.ones((2, 2, 1, 16), mx.bfloat16), mx.ones((2, 2, 1, 16), mx.bfloat16))
    assert not grows_ahead.tend(runtime, _batch(ours))  # type: ignore[arg-type]
    with spares.GROWS.naming(runtime.grow_spares):  # inside a decode step
        token = mx.ones((2, 2, 1, 16), mx.bfloat16)
        assert hooks.kv_rows_write(ours[0], token, token) is None  # mlx-vlm's own concatenation
    assert stager.jobs == []
