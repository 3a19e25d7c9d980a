"""Rows a leave kept where they were (issue 40): the record a cache carries meanwhile.

``copyfree.batch.filter_kv`` may keep the rows that stay in a decoding batch in the buffer they
were in: the cache's ``keys``/``values`` become views of those rows, and the record (``RowView``,
the cache's ``ROW_VIEW`` attribute) names the buffer, so the next writes go into it in place
(``copyfree.batch.write_kv``). Whoever reads a cache's rows to keep them (``state.rows``) asks
``live_view`` first: adopting such a view would pin the rows that left with it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import mlx.core as mx

ROW_VIEW = "_apc_row_view"  # the cache attribute that holds its ``RowView`` while it has one
# The cache attribute listing, per row, the first column of ``cache.keys`` the row may have
# written (its own padding included): left of it the row's columns are zero. Kept by
# ``copyfree.batch``'s join and leave; a cache without it (or with a stale one) counts as
# written from column 0.
WRITTEN_FROM = "_apc_written_from"


@dataclass
class RowView:
    """Rows a leave kept where they were: ``cache.keys``/``values`` show rows ``[first, end)``
    of ``keys``/``values`` (the buffers before the leave) from column ``column`` on, and
    ``copyfree.batch.write_kv`` writes the next tokens into those buffers. ``shown_*`` are the views the cache
    was given: once it holds others (a join, a regrow, any method of mlx-vlm's that sets them),
    the record is stale and is dropped (``live_view``), and the old buffers with it."""

    keys: mx.array
    values: mx.array
    first: int
    end: int
    column: int
    shown_keys: Optional[mx.array] = None
    shown_values: Optional[mx.array] = None
    # Rows of the buffer a leave freed: the first column each may have been written from (buffer
    # columns); a join that reuses one zeroes it from there (``copyfree.batch._into_free_rows``).
    dirty: dict[int, int] = field(default_factory=dict)


def show(cache: Any, view: RowView) -> None:
    """The cache's keys and values become views of ``view``'s rows, and the record its own."""
    rows, columns = slice(view.first, view.end), slice(view.column, None)
    cache.keys = view.shown_keys = view.keys[rows, :, columns, :]
    cache.values = view.shown_values = view.values[rows, :, columns, :]
    setattr(cache, ROW_VIEW, view)


@contextmanager
def unshown(cache: Any, view: RowView) -> Iterator[None]:
    """Within the block the cache shows none of ``view``'s rows, so the buffers have no other
    reference and MLX writes them in place; shown again (``show``) after."""
    cache.keys = cache.values = view.shown_keys = view.shown_values = None
    try:
        yield
    finally:
        show(cache, view)


def live_view(cache: Any) -> Optional[RowView]:
    """``cache``'s ``RowView`` while the cache still shows its views; a stale one is dropped."""
    view: Optional[RowView] = getattr(cache, ROW_VIEW, None)
    if view is None:
        return None
    if cache.keys is view.shown_keys and cache.values is view.shown_values:
        return view
    setattr(cache, ROW_VIEW, None)
    return None


def written_from(cache: Any, rows: int) -> list[int]:
    """``cache``'s ``WRITTEN_FROM`` for its ``rows`` rows, or column 0 for each where it has none."""
    starts: Optional[list[int]] = getattr(cache, WRITTEN_FROM, None)
    return list(starts) if starts is not None and len(starts) == rows else [0] * rows


__all__ = ["ROW_VIEW", "RowView", "WRITTEN_FROM", "live_view", "show", "unshown", "written_from"]
