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
