"""A join without a staged copy (a lent warm turn, a third row) finds its joint buffers made
ahead, off the generation thread (``integration.joins_ahead``, ``copyfree.batch.joint_shapes``,
``JointSpares.ahead``/``make``/``joined``, issue 40), and the logits through the join equal the
same turn's cold. In process, real mlx arrays and the tiny glm5_next model; the job runs on a
``BackgroundLoads`` thread, as on the runtime's stager.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.cache import BatchKVCache

from server_patch.copyfree import batch, merge
from server_patch.copyfree.spares import JointSpares
from server_patch.disk.loader import BackgroundLoads
from server_patch.integration import joins_ahead
from server_patch.state.rows import leaf_caches
from tests.copyfree.test_batch_join_leave import _cache, _copyfree, _decode, _rows_cache, _same
from tests.fake_model import prefill, random_tokens

PREFIX, SUFFIX = 150, 12


class _PromptBatch:
    """What ``joins_ahead.ask`` reads of mlx-vlm's ``PromptProcessingBatch``."""

    def __init__(self, caches: list[Any], columns: int) -> None:
        self.prompt_cache = caches
        self._input_ids = mx.zeros((1, columns), dtype=mx.int32)


def _generator(caches: list[Any], rows: int) -> SimpleNamespace:
    return SimpleNamespace(_generation_batch=SimpleNamespace(uids=list(range(rows)), prompt_cache=caches))


def _ask(spares: JointSpares, decoding: list[Any], rows: int, joiner: _PromptBatch) -> None:
    """``hooks.prefill_step``'s ask at the joiner's first chunk; the stager's job waited for."""
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-stager")
    made: list[Future[Any]] = []

    def submit(job: Any, *args: Any) -> Future[Any]:
        made.append(thread.submit(job, *args))
        return made[-1]

    runtime = SimpleNamespace(spares=spares, stages=BackgroundLoads(submit=submit))
    assert joins_ahead.ask(runtime, _generator(decoding, rows), joiner)  # type: ignore[arg-type]
    assert not joins_ahead.ask(runtime, _generator(decoding, rows), joiner)  # asked once per prompt batch
    assert len(made) == 1 and made[0].result(timeout=120) is True  # made, off this thread
    thread.shutdown()


def _lent(model: Any, tokens: np.ndarray) -> list[Any]:
    """A warm turn lent its entry's buffer: the prefix's single-row caches adopted in place by the
    merge (``merge_rows(lend=True)``), with room for the suffix and the decode reserve."""
    rows = model.make_cache()
    prefill(model, rows, tokens)
    caches = merge.merge_rows([rows], [len(tokens)], [SUFFIX], 64, lend=True)
    assert caches is not None
    return caches


def _story(model: Any, spares: JointSpares | None) -> tuple[list[np.ndarray], list[Any]]:
    """Two streams decode; a 162-token turn joins them as a third row, restored lent (``spares``
    given: its joint buffers asked for at its first chunk) or cold (None, mlx-vlm's join). The
    decode steps' logits, and the buffers the join wrote into."""
    seen: list[np.ndarray] = []
    cache, a = _rows_cache(model, random_tokens(20, seed=5))
    [a] = _decode(model, cache, [a], 2, seen)
    second, b = _rows_cache(model, random_tokens(30, seed=6))
    for mine, theirs in zip(cache, second):
        mine.extend(theirs)
    a, b = _decode(model, cache, [a, b], 2, seen)
    turn = random_tokens(PREFIX + SUFFIX, seed=7)
    if spares is None:
        joining, c = _rows_cache(model, turn)
        [a, b] = _decode(model, cache, [a, b], 1, seen)
    else:
        joining = _lent(model, turn[:PREFIX])
        _ask(spares, cache, 2, _PromptBatch(joining, SUFFIX))
        [a, b] = _decode(model, cache, [a, b], 1, seen)  # a decode step while it prefills
        logits = prefill(model, joining, turn[PREFIX:])
        c = int(mx.argmax(logits, axis=-1).item())
    for mine, theirs in zip(cache, joining):
        mine.extend(theirs)
    written = [x for leaf in leaf_caches(cache) if type(leaf) is BatchKVCache for x in (leaf.keys, leaf.values)]
    _decode(model, cache, [a, b, c], 3, seen)
    return seen, written


def test_a_lent_third_row_joins_into_buffers_made_ahead_and_its_logits_equal_cold(model: Any) -> None:
    cold, _ = _story(model, None)
    spares = JointSpares()
    with pytest.MonkeyPatch.context() as patch:
        _copyfree(patch)
        patch.setattr(BatchKVCache, "extend", lambda self, other: batch.extend_kv(self, other, spares))
        made_ahead: list[int] = []
        make = spares.make

        def make_noted(ticket: int, shapes: Any) -> bool:
            held = make(ticket, shapes)
            made_ahead.extend(id(x) for x in spares._spares)
            return held

        patch.setattr(spares, "make", make_noted)
        lent, written = _story(model, spares)
    assert made_ahead and spares.count() == 0  # every buffer made ahead was taken by the join
    assert {id(x) for x in written} == set(made_ahead)  # the join wrote into them: none allocated
    assert spares.joined() == 0  # nothing left over to let go
    assert len(lent) == len(cold) == 8
    for step, (a, b) in enumerate(zip(cold, lent)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=f"decode step {step}")


def _lone(model: Any, tokens: np.ndarray) -> tuple[list[Any], int]:
    """A lone stream's caches: the model's own (``KVCache`` layers), as mlx-vlm decodes one row."""
    cache = model.make_cache()
    logits = prefill(model, cache, tokens)
    return cache, int(mx.argmax(logits, axis=-1).item())


def _extended(a: list[Any], b: list[Any], one_row: bool) -> list[Any]:
    """mlx-vlm's ``_extend_cache``: single-row entries merged first (mlx-vlm's merge, or the
    door's ``one_row`` as the overlay's edit does), then extended."""
    from mlx_vlm.generate.ar import _is_batch_cache_entry

    joined = []
    for ca, cb in zip(a, b):
        ca, cb = (c if _is_batch_cache_entry(c) else batch.one_row(c) if one_row else type(c).merge([c])
                  for c in (ca, cb))
        ca.extend(cb)
        joined.append(ca)
    return joined


def test_a_lone_streams_own_caches_join_uncopied_into_buffers_made_ahead(model: Any) -> None:
    """A lone stream decodes in its model's ``KVCache`` layers; a short row joins. mlx-vlm merges
    each into a fresh buffer and then extends; ``one_row`` shows the stream's buffer as a batch of
    one (no copy), so the join writes each row once, into the buffers ``joint_shapes`` asked for."""
    from mlx_vlm.models.cache import KVCache

    seen_stock: list[np.ndarray] = []
    seen_ours: list[np.ndarray] = []
    stock_a, a = _lone(model, random_tokens(40, seed=21))
    stock_b, b = _lone(model, random_tokens(25, seed=22))
    ours_a, _ = _lone(model, random_tokens(40, seed=21))
    ours_b, _ = _lone(model, random_tokens(25, seed=22))
    lone_kv = [leaf for leaf in leaf_caches(ours_a) if type(leaf) is KVCache and leaf.keys is not None]
    assert lone_kv and all(batch.one_row(leaf).keys is leaf.keys for leaf in lone_kv)  # shown, not copied
    spares = JointSpares()
    shapes = batch.joint_shapes(ours_a, ours_b, 0)
    assert len(shapes) == 2 * len(lone_kv)  # the KVCache layers count as one-row batches
    ticket = spares.ahead(_PromptBatch(ours_b, 0), shapes)
    assert ticket is not None and spares.make(ticket, shapes)
    made = {id(x) for x in spares._spares}
    stock = _extended(stock_a, stock_b, one_row=False)
    with pytest.MonkeyPatch.context() as patch:
        _copyfree(patch)
        patch.setattr(BatchKVCache, "extend", lambda self, other: batch.extend_kv(self, other, spares))
        ours = _extended(ours_a, ours_b, one_row=True)
        joined = [leaf for leaf in leaf_caches(ours) if type(leaf) is BatchKVCache]
        assert spares.count() == 0 and {id(x) for leaf in joined for x in (leaf.keys, leaf.values)} == made
        for mine, theirs in zip(leaf_caches(stock), leaf_caches(ours)):
            if type(mine) is BatchKVCache:
                _same(mine, theirs)
        _decode(model, ours, [a, b], 4, seen_ours)
    _decode(model, stock, [a, b], 4, seen_stock)
    for step, (x, y) in enumerate(zip(seen_stock, seen_ours)):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5, err_msg=f"decode step {step}")


# --- the shapes and the set's life, on plain buffers ------------------------------------------

def test_joint_shapes_fit_the_join_after_its_prefill_and_decode_steps() -> None:
    """A 2-row batch decodes (one row at a buffer's end: it regrows meanwhile); a lent row with
    room prefills 40 columns. The buffers asked for are what the join takes."""
    decoding = _cache(2, 2, 256, 250, [0, 30], 16, 16, mx.bfloat16, 1)
    joining = _cache(1, 2, 512, 300, [0], 16, 16, mx.bfloat16, 2)
    spares = JointSpares()
    shapes = batch.joint_shapes([decoding], [joining], 40)
    # up to 256 decode steps meanwhile (their row's end 506, a step of room past it); the join
    # itself needs 596 (write index 340 + a step): the buffer is under twice that, so it fits
    assert [s for s, _ in shapes] == [(3, 2, 762, 16), (3, 2, 762, 16)]
    ticket = spares.ahead(joining, shapes)
    assert ticket is not None and spares.make(ticket, shapes) and spares.count() == 2
    for _ in range(10):  # decode steps: 250 -> 260 regrows its 256-wide buffer
        decoding.update_and_fetch(mx.zeros((2, 2, 1, 16), mx.bfloat16), mx.zeros((2, 2, 1, 16), mx.bfloat16))
    joining.update_and_fetch(mx.ones((1, 2, 40, 16), mx.bfloat16), mx.ones((1, 2, 40, 16), mx.bfloat16))
    stock = _cache(2, 2, 256, 250, [0, 30], 16, 16, mx.bfloat16, 1)
    stock.keys, stock.values, stock._idx, stock.offset = decoding.keys, decoding.values, decoding._idx, decoding.offset
    other = _cache(1, 2, 512, 300, [0], 16, 16, mx.bfloat16, 2)
    other.keys, other.values, other._idx, other.offset = joining.keys, joining.values, joining._idx, joining.offset
    stock.extend(other)
    batch.extend_kv(decoding, joining, spares)
    assert spares.count() == 0 and decoding.keys.shape == (3, 2, 762, 16)
    _same(stock, decoding)


def test_a_set_made_after_its_join_or_fitting_nothing_is_let_go() -> None:
    decoding = _cache(1, 2, 256, 20, [0], 16, 16, mx.bfloat16, 1)
    joining = _cache(1, 2, 512, 300, [0], 16, 16, mx.bfloat16, 2)
    shapes = batch.joint_shapes([decoding], [joining], 10)
    spares = JointSpares()
    late = spares.ahead(joining, shapes)
    assert late is not None and spares.asked(joining)
    assert spares.joined() == 0 and not spares.asked(joining)  # the join came first: it allocated
    assert not spares.make(late, shapes) and spares.count() == 0  # made after it: nothing kept
    ticket = spares.ahead(joining, shapes)
    assert ticket is not None and spares.make(ticket, shapes)
    batch.extend_kv(_cache(2, 2, 256, 20, [0, 3], 16, 16, mx.bfloat16, 3), joining, spares)  # a row more
    assert spares.count() == 2 and spares.joined() == 2 and spares.count() == 0


def test_a_staged_turns_set_that_fits_is_not_made_again_and_staging_waits_for_a_known_join() -> None:
    decoding = _cache(1, 2, 256, 20, [0], 16, 16, mx.bfloat16, 1)
    joining = _cache(1, 2, 768, 300, [0], 16, 16, mx.bfloat16, 2)
    spares = JointSpares()
    spares.reserve([joining.keys, joining.values])  # the staged turn's 2-row set, 768 wide
    assert spares.ahead(joining, batch.joint_shapes([decoding], [joining], 12)) is None  # it fits: kept
    assert spares.joined() == 0 and spares.count() == 2  # not made for it: kept for its own join
    three = batch.joint_shapes([_cache(2, 2, 256, 20, [0, 1], 16, 16, mx.bfloat16, 3)], [joining], 12)
    ticket = spares.ahead(joining, three)
    assert ticket is not None and spares.make(ticket, three)
    spares.reserve([joining.keys, joining.values])  # a staging meanwhile: the known join's set stays
    assert [int(x.shape[0]) for x in spares._spares] == [3, 3]


# --- a finished prompt batch waits for its set while the stager makes it ----------------------

class _HeldStager:
    """A stager whose job starts only when ``release`` is called (it is busy meanwhile)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, tuple[Any, ...]]] = []
        self.done: list[Any] = []

    def run(self, job: Any, *args: Any) -> None:
        self.jobs.append((job, args))

    def release(self) -> None:
        self.done += [job(*args) for job, args in self.jobs]
        self.jobs.clear()


def _waiting(patch: pytest.MonkeyPatch, wait_ms: float) -> tuple[SimpleNamespace, SimpleNamespace, _PromptBatch,
                                                                  _HeldStager]:
    """A 1,000-token row decodes; a short prompt batch has asked for its join's set, which the
    held stager has not made yet."""
    from server_patch.copyfree import pool
    from server_patch.copyfree.settings import CopyFreeSettings

    patch.setattr(pool, "_settings", CopyFreeSettings(join_wait_ms=wait_ms))
    decoding = _cache(1, 2, 1024, 1000, [0], 16, 16, mx.bfloat16, 1)
    joiner = _PromptBatch([_cache(1, 2, 256, 100, [0], 16, 16, mx.bfloat16, 2)], 20)
    stager = _HeldStager()
    runtime = SimpleNamespace(spares=JointSpares(), stages=stager)
    generator = _generator([decoding], 1)
    assert joins_ahead.ask(runtime, generator, joiner)  # type: ignore[arg-type]
    return runtime, generator, joiner, stager


def test_a_join_waits_while_its_set_is_made_and_goes_once_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, generator, joiner, stager = _waiting(monkeypatch, 60_000)
    assert joins_ahead.waits(runtime, generator, joiner)  # type: ignore[arg-type]
    assert joins_ahead.waits(runtime, generator, joiner)  # type: ignore[arg-type]  # the next step too
    assert not joins_ahead.waits(runtime, generator, _PromptBatch([], 0))  # type: ignore[arg-type]  # not its set
    stager.release()
    assert stager.done == [True] and runtime.spares.count() == 2
    assert not joins_ahead.waits(runtime, generator, joiner)  # type: ignore[arg-type]  # made: it joins
    runtime2, generator2, joiner2, _ = _waiting(monkeypatch, 60_000)
    generator2._generation_batch.uids = []  # nobody decoding: nothing to wait for
    assert not joins_ahead.waits(runtime2, generator2, joiner2)  # type: ignore[arg-type]


def test_a_join_waits_no_longer_than_its_limit_nor_for_a_set_the_budget_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from server_patch import clock

    now = [1000.0]
    monkeypatch.setattr(clock, "steady", lambda: now[0])
    runtime, generator, joiner, stager = _waiting(monkeypatch, 500)
    assert joins_ahead.waits(runtime, generator, joiner)  # type: ignore[arg-type]
    now[0] += 0.4
    assert joins_ahead.waits(runtime, generator, joiner)  # type: ignore[arg-type]
    now[0] += 0.2  # 600 ms since it first waited: it joins, allocating
    assert not joins_ahead.waits(runtime, generator, joiner)  # type: ignore[arg-type]

    runtime, generator, joiner, stager = _waiting(monkeypatch, 60_000)
    runtime.spares.budget = SimpleNamespace(reserve_spare=lambda *a: False, release=lambda *a: 0)
    stager.release()  # the set is refused: nothing will come
    assert stager.done == [False]
    assert not joins_ahead.waits(runtime, generator, joiner)  # type: ignore[arg-type]
    runtime0, generator0, joiner0, _ = _waiting(monkeypatch, 0)  # APC_COPYFREE_JOIN_WAIT_MS=0: never waits
    assert not joins_ahead.waits(runtime0, generator0, joiner0)  # type: ignore[arg-type]


def test_a_join_into_rows_a_leave_freed_asks_no_buffers_and_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long row that a short one left: the next short joiner goes into the freed row
    (``batch._into_free_rows``), so nothing is made for it and its join never waits."""
    from server_patch.copyfree import pool
    from server_patch.copyfree.settings import CopyFreeSettings

    monkeypatch.setattr(pool, "_settings", CopyFreeSettings(join_wait_ms=60_000))
    long_row = _cache(1, 2, 1024, 1000, [0], 16, 16, mx.bfloat16, 3)
    batch.extend_kv(long_row, _cache(1, 2, 256, 30, [0], 16, 16, mx.bfloat16, 4))
    batch.filter_kv(long_row, [0])  # the visitor left: its row is free
    visitor = _PromptBatch([_cache(1, 2, 256, 0, [0], 16, 16, mx.bfloat16, 5)], 40)
    busy = _HeldStager()
    runtime = SimpleNamespace(spares=JointSpares(), stages=busy)
    generator = _generator([long_row], 1)
    assert batch.joins_into_free_rows([long_row], visitor.prompt_cache, 40)
    assert not joins_ahead.ask(runtime, generator, visitor)  # type: ignore[arg-type]
    assert busy.jobs == [] and not joins_ahead.waits(runtime, generator, visitor)  # type: ignore[arg-type]
    wide = _PromptBatch([_cache(1, 2, 2048, 0, [0], 16, 16, mx.bfloat16, 6)], 1500)  # wider: it cannot
    assert not batch.joins_into_free_rows([long_row], wide.prompt_cache, 1500)
    assert joins_ahead.ask(runtime, generator, wide)  # type: ignore[arg-type]
