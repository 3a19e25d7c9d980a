"""A row joining or leaving the decoding batch: each KV row moved once, at its own width (issue 40).

mlx-vlm's ``BatchKVCache.extend`` pads both batches to the longer one's buffer (a fresh
allocation for the short batch, its rows copied) and then concatenates them (a second fresh
allocation, every row copied again): a 200-token stream that a 16k-token turn joins is copied
to 16k width and then copied again, with the long row. ``BatchKVCache.filter`` gathers the kept
rows at the full width *before* it drops the left padding that no kept row needs, so the short
row that stays behind is gathered at the long row's width; the narrowed view is then copied
once more by the next ``update_and_fetch`` (MLX writes a view by copying it first).

Here, with ``APC_COPYFREE`` and ``APC_COPYFREE_JOIN`` on (either ``=0``: mlx-vlm's own methods):

* ``extend_kv``: one zero-filled buffer of the joint batch, each side's rows written once into
  it, right-aligned at the longer side's write index (the layout ``extend`` builds), with at
  least one allocation step of room past it so the first joint decode step does not regrow it.
  A staged turn (``merge.stage_rows``, off the generation thread) has that buffer made ahead
  (``JointSpares.reserve``, its runtime's): its join then only writes the rows, into pages already mapped.
  So does every other join whose prompt batch starts prefilling while rows decode (a lent or
  cold joiner, a third row, a decoding row wider than the joiner): ``joint_shapes`` bounds its
  buffers at the first chunk and the runtime's stager makes them (``integration.joins_ahead``).
  ``bench copies --context 8192`` (load ~4-5): a lent joiner's join into buffers made ahead
  38 ms (median), against 641 ms allocating at the join and 843 ms for mlx-vlm's ``extend``.
* ``filter_kv``: the padding no kept row needs is dropped first. Kept rows that are a contiguous
  range and fill at least half of the buffer (``IN_PLACE_MIN_SHARE``: a long row that stays
  when a short one leaves) stay where they are: ``cache.keys`` becomes a view of them
  (``RowView``) and ``write_kv`` (the patched ``update_and_fetch``, through the door) writes each
  next token into the old buffer itself, in place, so nothing is copied at the leave nor at the
  next step; the rows that left are let go at the next regrow (within one allocation step of
  decode steps, 256: mlx-vlm's regrow copies every row anyway) or when the batch ends. Other
  kept rows are copied once into their own buffer (a batch-axis slice when contiguous, a gather
  otherwise), which lets the joint buffer go at once. A plain view would not spare the copy:
  MLX copies a view at its first write (``bench copies``' "view" row).

The arrays over ``[:_idx]`` and the offsets, left padding and write index are exactly mlx-vlm's,
so the masks and the logits are unchanged. Only ``BatchKVCache`` itself takes this path
(quantized and rotating caches keep mlx-vlm's methods); the patched ``models/cache.py`` calls
``takes_over`` and then these functions.

Not built: a batch buffer with a free row (headroom), so that a join writes only the joiner's
row and the rows already in the batch stay put. Measured (MLX 0.32.4, bench preset, an 8k-token
decoding row, a 256-token joiner; docs/benchmarks.md): the write into a free row of a buffer
with one reference is in place (11 ms, no allocation, against 1.7 s for ``extend_kv`` allocating
at the join), but a second reference to the buffer makes MLX copy all of it (1.6 s). And
mlx-vlm cannot be shown the free row: ``update_and_fetch`` writes ``keys[..., prev:idx, :]``
with the batch's row count, so ``cache.keys`` would have to be a view of the first rows, and
MLX copies a view at its first write (the first decode step: 0.7 s, and the free row is gone).
It would need ``update_and_fetch`` to write into the full buffer itself (in place when it drops
its view first: measured 0.33 ms a step) and a free row as wide as the batch held at all times.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, cast

import mlx.core as mx

from server_patch.copyfree import pool, spares
from server_patch.copyfree.spares import JointSpares, Shape
from server_patch.state.row_view import ROW_VIEW, RowView, live_view, show
from server_patch.state.rows import leaf_caches


def takes_over(cache: Any) -> bool:
    """Whether ``cache``'s join and leave go through this module: ``APC_COPYFREE`` and
    ``APC_COPYFREE_JOIN`` on and a plain ``BatchKVCache`` (not a subclass with buffers of its
    own)."""
    from mlx_vlm.models.cache import BatchKVCache

    return type(cache) is BatchKVCache and takes_joins()


def takes_joins() -> bool:
    """``APC_COPYFREE`` and ``APC_COPYFREE_JOIN`` on."""
    settings = pool.settings()
    return settings.enabled and settings.join


def extend_kv(cache: Any, other: Any, joint: JointSpares | None = None) -> None:
    """``cache.extend(other)``: ``other``'s rows after ``cache``'s, each copied once; the joint
    buffers are one of ``joint`` (the joining runtime's made ahead) where one fits."""
    if cache.keys is None and other.keys is None:
        cache.left_padding = mx.concatenate([cache.left_padding, other.left_padding])
        cache.offset = mx.concatenate([cache.offset, other.offset])
        return
    sides = (cache, other)
    template = next(c for c in sides if c.keys is not None)
    heads, dk, dv = int(template.keys.shape[1]), int(template.keys.shape[3]), int(template.values.shape[3])
    write_index = max(int(c._idx) for c in sides)
    width = max(max(_width(c) for c in sides), write_index + int(type(cache).step))
    counts = [_rows(c) for c in sides]
    keys = spares.buffer(joint, (sum(counts), heads, width, dk), template.keys.dtype)
    values = spares.buffer(joint, (sum(counts), heads, width, dv), template.values.dtype)
    first = 0
    for side, count in zip(sides, counts):
        held = int(side._idx)
        if side.keys is not None and held > 0:
            start = write_index - held
            keys[first: first + count, :, start:write_index, :] = side.keys[..., :held, :]
            values[first: first + count, :, start:write_index, :] = side.values[..., :held, :]
        first += count
    cache.keys, cache.values = keys, values
    for side in sides:  # a kept-in-place record is stale now: the old buffers go with it
        setattr(side, ROW_VIEW, None)
    cache.offset = mx.concatenate([c.offset for c in sides])
    cache.left_padding = mx.concatenate([c.left_padding + (write_index - int(c._idx)) for c in sides])
    cache._idx = write_index


def one_row(cache: Any) -> Any:
    """``type(cache).merge([cache])`` for a single-row cache, as mlx-vlm's ``_extend_cache``
    makes one before a join (a lone stream decodes in its model's own ``KVCache``): a
    ``KVCache``'s buffer shown as a one-row ``BatchKVCache`` without a copy (mlx-vlm's merge
    copies the row into a fresh buffer of its exact length, which the join then copies again and
    the first decode step regrows), the children of a ``CacheList`` the same way, any other cache
    mlx-vlm's merge. Only for a join, which writes the row into its joint buffer next and keeps
    no reference to this one (``extend_kv``; mlx-vlm's ``extend`` concatenates into new ones)."""
    from mlx_vlm.models.cache import BatchKVCache, CacheList, KVCache

    if type(cache) is KVCache and cache.keys is not None:
        row = BatchKVCache([0])
        row.keys, row.values = cache.keys, cache.values
        row._idx = int(cache.offset)
        row.offset = mx.array([int(cache.offset)])
        return row
    if type(cache) is CacheList:
        return CacheList(*(one_row(child) for child in cache.caches))  # type: ignore[no-untyped-call]
    return type(cache).merge([cache])


def joint_shapes(decoding: Sequence[Any], joining: Sequence[Any], tokens: int,
                 steps: Optional[int] = None) -> list[Shape]:
    """The buffers ``extend_kv`` will want when the prompt batch ``joining`` (its per-layer
    caches) joins the decoding batch ``decoding``, once ``joining`` has written ``tokens`` more
    (its prompt columns left) and ``decoding`` at most ``steps`` more (decode steps meanwhile;
    default one allocation step). Upper bounds, a step or so past the join's need
    (``JointSpares.take`` takes a buffer up to twice as wide); rows are those of both batches
    now. Only layers whose join this module makes: plain ``BatchKVCache`` on both sides, or a
    single row's ``KVCache``, which ``one_row`` shows as one."""
    shapes: list[Shape] = []
    ours, others = list(leaf_caches(decoding)), list(leaf_caches(joining))
    if len(ours) != len(others):
        return shapes  # not the same layers (a draft model's too?): nothing is known ahead
    for mine, theirs in zip(ours, others):
        if not (_joinable(mine) and _joinable(theirs)):
            continue
        template = mine if mine.keys is not None else theirs
        if template.keys is None:
            continue
        step = int(type(mine).step)
        ends = (_index(mine) + (step if steps is None else steps), _index(theirs) + tokens)
        widths = [_width(c) if end <= _width(c) else -(-end // step) * step for c, end in zip((mine, theirs), ends)]
        width = max(*widths, max(ends) + step)
        rows, heads = _rows(mine) + _rows(theirs), int(template.keys.shape[1])
        shapes.append(((rows, heads, width, int(template.keys.shape[3])), template.keys.dtype))
        shapes.append(((rows, heads, width, int(template.values.shape[3])), template.values.dtype))
    return shapes


# How a leave keeps its rows: in place where they are worth it (the default), copied into a
# buffer of their own, or a plain view that mlx-vlm's next write copies (``bench copies``).
Leave = Literal["in_place", "copy", "view"]
IN_PLACE_MIN_SHARE = 0.5  # kept rows stay in place when they fill at least this much of the buffer


def filter_kv(cache: Any, batch_indices: mx.array | Sequence[int], *, leave: Leave = "in_place") -> None:
    """``cache.filter(batch_indices)``: the kept rows, from the first column a kept row uses;
    kept in place where they are a contiguous range filling at least ``IN_PLACE_MIN_SHARE`` of
    the buffer, else copied once. ``leave="copy"`` always copies; ``leave="view"`` keeps a
    plain view that mlx-vlm's next ``update_and_fetch`` copies (``bench copies`` measures both)."""
    kept = _as_list(batch_indices)
    index = mx.array(kept, dtype=mx.int32)
    cache.offset = cache.offset[index]
    cache.left_padding = cache.left_padding[index]
    if cache._right_padding is not None:
        cache._right_padding = cache._right_padding[index]
    shift = min(int(cache.left_padding.min().item()), int(cache._idx)) if kept else 0
    if cache.keys is not None:
        span, view = contiguous_range(kept), live_view(cache)
        if span == (0, int(cache.keys.shape[0])) and shift == 0:
            pass  # nothing leaves and no column is dropped: nothing to move
        elif span is not None and leave == "in_place" and _worth_keeping(cache, view, span, shift):
            _keep_in_place(cache, view, span, shift)
        else:  # copied: the buffer (and any older one the cache's rows were a view of) is let go
            setattr(cache, ROW_VIEW, None)
            cache.keys = _kept(cache.keys, index, span, shift, leave == "view")
            cache.values = _kept(cache.values, index, span, shift, leave == "view")
    if shift > 0:
        cache._idx -= shift
        cache.left_padding = cache.left_padding - shift


def write_kv(cache: Any, keys: mx.array, values: mx.array) -> Optional[tuple[mx.array, mx.array]]:
    """``cache.update_and_fetch(keys, values)`` for a cache whose rows a leave kept in place:
    the tokens written into the old buffer itself (in place: the cache's views are dropped
    first, so the buffer has no other reference), and the views over ``[:_idx]`` returned as
    mlx-vlm returns them. None (mlx-vlm writes) where the cache has no live ``RowView`` or the
    tokens do not fit its width: mlx-vlm's regrow then copies the kept rows into a new buffer,
    as it copies every row at each regrow, and the old buffer is let go."""
    view = live_view(cache)
    if view is None:
        return None
    prev, count = int(cache._idx), int(keys.shape[2])
    if prev + count > int(cache.keys.shape[2]) or int(keys.shape[0]) != view.end - view.first:
        setattr(cache, ROW_VIEW, None)
        return None
    cache.keys = cache.values = view.shown_keys = view.shown_values = None
    rows, at = slice(view.first, view.end), view.column + prev
    view.keys[rows, :, at: at + count, :] = keys
    view.values[rows, :, at: at + count, :] = values
    show(cache, view)
    cache.offset += count
    cache._idx += count
    return cache.keys[..., : cache._idx, :], cache.values[..., : cache._idx, :]


def _worth_keeping(cache: Any, view: Optional[RowView], span: tuple[int, int], shift: int) -> bool:
    """The kept rows, from column ``shift``, fill at least ``IN_PLACE_MIN_SHARE`` of the buffer
    they would keep alive (``cache.keys``, or the older buffer ``view`` shows it from)."""
    rows, width = (int(n) for n in (cache.keys.shape[0], cache.keys.shape[2]))
    if view is not None:
        rows, width = int(view.keys.shape[0]), int(view.keys.shape[2])
        shift += view.column
    kept = (span[1] - span[0]) * (width - shift)
    return kept >= IN_PLACE_MIN_SHARE * rows * width


def _keep_in_place(cache: Any, view: Optional[RowView], span: tuple[int, int], shift: int) -> None:
    """The kept rows shown in place: narrowing ``view`` (the cache's live one), or a new record
    of the buffer the cache holds."""
    view = view or RowView(cache.keys, cache.values, 0, int(cache.keys.shape[0]), 0)
    view.first, view.end = view.first + span[0], view.first + span[1]
    view.column += shift
    show(cache, view)


def contiguous_range(kept: Sequence[int]) -> Optional[tuple[int, int]]:
    """``(first, last + 1)`` when ``kept`` is consecutive ascending rows, else None."""
    if kept and list(kept) == list(range(kept[0], kept[0] + len(kept))):
        return kept[0], kept[0] + len(kept)
    return None


def _kept(buffer: mx.array, index: mx.array, span: Optional[tuple[int, int]], shift: int,
          view: bool) -> mx.array:
    """The kept rows of ``buffer`` from column ``shift`` on, in a buffer of their own."""
    narrowed = buffer[..., shift:, :] if shift > 0 else buffer
    if span is None:
        return mx.take(narrowed, index, axis=0)  # a gather writes a new buffer
    first, end = span
    if first == 0 and end == int(buffer.shape[0]) and shift == 0:
        return buffer  # nothing leaves and no column is dropped: nothing to move
    rows = narrowed[first:end]
    return rows if view else mx.take(narrowed, mx.arange(first, end), axis=0)


def _as_list(batch_indices: mx.array | Sequence[int]) -> list[int]:
    if isinstance(batch_indices, mx.array):
        # mlx types tolist() for any shape; a 1-D index array's is a list of ints
        return [int(i) for i in cast(list[int], batch_indices.tolist())]
    return [int(i) for i in batch_indices]


def _joinable(cache: Any) -> bool:
    """A layer whose join ``extend_kv`` makes: a plain ``BatchKVCache``, or a ``KVCache`` (one
    row, ``one_row``)."""
    from mlx_vlm.models.cache import KVCache

    return takes_over(cache) or (type(cache) is KVCache and takes_joins())


def _index(cache: Any) -> int:
    """The write index: a ``BatchKVCache``'s ``_idx``, a ``KVCache``'s offset."""
    return int(cache._idx) if hasattr(cache, "_idx") else int(cache.offset)


def _rows(cache: Any) -> int:
    if cache.keys is not None:
        return int(cache.keys.shape[0])
    return int(cache.offset.shape[0]) if isinstance(cache.offset, mx.array) else 1


def _width(cache: Any) -> int:
    return int(cache.keys.shape[2]) if cache.keys is not None else 0
