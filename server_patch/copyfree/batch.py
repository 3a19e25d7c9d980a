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
* A join into rows a leave freed: where the decoding rows were kept in place by a leave and
  the joiner is no wider than they are, its rows go into the free rows after them
  (``_into_free_rows``) and the decoding rows do not move (a long stream that short requests
  join and leave one after another copies its row once, at the first).
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

Free rows come only from leaves: the rows a leave kept in place are written through the door
(``write_kv``, the patched ``update_and_fetch``: mlx-vlm writes with the batch's row count, so
it cannot be shown a free row), and the next narrower joiner goes into the rows that left. Not
built: a free row held from the start (headroom), so that the first join too writes only the
joiner's row. It costs a row as wide as the batch for as long as it decodes (a lone long stream's
cache doubled); measured (MLX 0.32.4, bench preset, 8k tokens, docs/benchmarks.md): the write
into a free row of a buffer with one reference is in place (11 ms), against 38 ms for the join
into buffers made ahead, so it would gain little where the stager made them in time.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, cast

import mlx.core as mx

from server_patch.copyfree import pool, spares
from server_patch.copyfree.spares import JointSpares, Shape
from server_patch.state.row_view import ROW_VIEW, WRITTEN_FROM, RowView, live_view, show, unshown, written_from
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
    if _into_free_rows(cache, other):
        return
    sides = (cache, other)
    template = next(c for c in sides if c.keys is not None)
    heads, dk, dv = int(template.keys.shape[1]), int(template.keys.shape[3]), int(template.values.shape[3])
    write_index = max(int(c._idx) for c in sides)
    width = max(max(_width(c) for c in sides), write_index + int(type(cache).step))
    counts = [_rows(c) for c in sides]
    keys = spares.buffer(joint, (sum(counts), heads, width, dk), template.keys.dtype)
    values = spares.buffer(joint, (sum(counts), heads, width, dv), template.values.dtype)
    first, starts = 0, []
    for side, count in zip(sides, counts):
        held = int(side._idx)
        start = write_index - held
        starts += [start + column for column in written_from(side, count)]
        if side.keys is not None and held > 0:
            keys[first: first + count, :, start:write_index, :] = side.keys[..., :held, :]
            values[first: first + count, :, start:write_index, :] = side.values[..., :held, :]
        first += count
    cache.keys, cache.values = keys, values
    setattr(cache, WRITTEN_FROM, starts)
    for side in sides:  # a kept-in-place record is stale now: the old buffers go with it
        setattr(side, ROW_VIEW, None)
    cache.offset = mx.concatenate([c.offset for c in sides])
    cache.left_padding = mx.concatenate([c.left_padding + (write_index - int(c._idx)) for c in sides])
    cache._idx = write_index


def _into_free_rows(cache: Any, other: Any) -> bool:
    """``extend_kv`` in place: where ``cache``'s rows were kept in place by a leave and the
    buffer has free rows right after them (the rows that left), and ``other``'s rows end at or
    before ``cache``'s write index, ``other``'s rows are written into those free rows and the
    rows already in the batch stay where they are: nothing of theirs moves. What the rows that
    left wrote left of the joiner's columns is zeroed first (from where each was written,
    ``RowView.dirty``: a short row's own width), so the rows equal mlx-vlm's ``extend``'s."""
    view = live_view(cache)
    if view is None or other.keys is None:
        return False
    count, held, index = _rows(other), int(other._idx), int(cache._idx)
    buffer, free = view.keys, range(view.end, view.end + count)
    if (not _free_rows_fit(view, count, held, index)
            or other.keys.shape[1::2] != buffer.shape[1::2] or other.values.shape[1::2] != view.values.shape[1::2]
            or other.keys.dtype != buffer.dtype or other.values.dtype != view.values.dtype):
        return False
    shown_from = written_from(cache, view.end - view.first)
    rows, at = slice(view.end, view.end + count), view.column + index
    with unshown(cache, view):
        for row in free:  # what the row that left wrote, left of the joiner's columns, zeroed
            dirty = view.dirty.pop(row)
            if dirty < at - held:
                view.keys[row: row + 1, :, dirty: at - held, :] = 0
                view.values[row: row + 1, :, dirty: at - held, :] = 0
        view.keys[rows, :, at - held: at, :] = other.keys[..., :held, :]
        view.values[rows, :, at - held: at, :] = other.values[..., :held, :]
        view.end += count
    setattr(other, ROW_VIEW, None)
    cache.offset = mx.concatenate([cache.offset, other.offset])
    cache.left_padding = mx.concatenate([cache.left_padding, other.left_padding + (index - held)])
    setattr(cache, WRITTEN_FROM, shown_from + [index - held + column for column in written_from(other, count)])
    return True


def _free_rows_fit(view: RowView, count: int, held: int, index: int) -> bool:
    """``count`` rows ending at ``held`` fit the free rows after ``view``'s rows, which write at
    ``index``: enough of them, each freed by a leave (its dirty columns known), the joiner no
    wider, and a step of room past ``index`` (else the first decode step would regrow)."""
    free = range(view.end, view.end + count)
    return (view.end + count <= int(view.keys.shape[0]) and held <= index
            and all(row in view.dirty for row in free) and index + 1 <= int(view.keys.shape[2]) - view.column)


def joins_into_free_rows(decoding: Sequence[Any], joining: Sequence[Any], tokens: int) -> bool:
    """Whether the prompt batch ``joining`` (its per-layer caches), once it has written
    ``tokens`` more, will join ``decoding`` into free rows in every layer ``extend_kv`` joins
    (``_into_free_rows``): its join then needs no buffers made ahead."""
    pairs = [(mine, theirs) for mine, theirs in zip(leaf_caches(decoding), leaf_caches(joining))
             if _joinable(mine) and _joinable(theirs)]
    for mine, theirs in pairs:
        view = live_view(mine)
        if view is None or not _free_rows_fit(view, _rows(theirs), _index(theirs) + tokens, _index(mine)):
            return False
    return bool(pairs)


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
        starts = written_from(cache, int(cache.keys.shape[0]))
        setattr(cache, WRITTEN_FROM, [max(0, starts[row] - shift) for row in kept])
        if span == (0, int(cache.keys.shape[0])) and shift == 0:
            pass  # nothing leaves and no column is dropped: nothing to move
        elif span is not None and leave == "in_place" and _worth_keeping(cache, view, span, shift):
            _keep_in_place(cache, view, span, shift, starts)
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
    rows, at = slice(view.first, view.end), view.column + prev
    with unshown(cache, view):
        view.keys[rows, :, at: at + count, :] = keys
        view.values[rows, :, at: at + count, :] = values
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


def _keep_in_place(cache: Any, view: Optional[RowView], span: tuple[int, int], shift: int,
                   starts: Sequence[int]) -> None:
    """The kept rows shown in place: narrowing ``view`` (the cache's live one), or a new record
    of the buffer the cache holds; the rows that left are free rows of it, each dirty from the
    first column it was written (``starts``, the cache's ``written_from`` before the leave)."""
    view = view or RowView(cache.keys, cache.values, 0, int(cache.keys.shape[0]), 0)
    for row, start in enumerate(starts):
        if not span[0] <= row < span[1]:
            view.dirty[view.first + row] = view.column + start
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
