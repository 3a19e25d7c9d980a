"""Zero-filled joint batch buffers made ahead, off the generation thread (issue 40).

A turn whose restore is staged (``merge.stage_rows``) will join the decoding batch once its
suffix is prefilled. ``reserve_joint`` makes the zero buffers of that 2-row joint batch there,
so ``batch.extend_kv`` (through ``joint``) writes the rows into pages already mapped instead of
allocating, and faulting in, a buffer of the joint batch's size on the generation thread. Only
the latest staging's spares are kept; the pool's idle release drops any a join never took.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import mlx.core as mx

_spares_lock = threading.Lock()
_spares: list[mx.array] = []


def reserve_joint(buffers: Sequence[mx.array], rows: int = 2) -> None:
    """Zero buffers of ``rows`` rows shaped like each of ``buffers`` (a staged row's KV
    children, ``[1, heads, capacity, dim]``), evaluated here, off the generation thread: the
    joint batch the staged row's join will write into. Its pages are touched now, so the join
    writes the long row's tokens into memory already mapped instead of allocating (and
    faulting in) a buffer of the joint batch's size on the generation thread. Replaces the
    spares of an earlier staging; the pool's idle release drops any a join never took."""
    made = [mx.zeros((rows, *b.shape[1:]), dtype=b.dtype) for b in buffers]
    mx.eval(made)
    with _spares_lock:
        _spares[:] = made


def spare_count() -> int:
    with _spares_lock:
        return len(_spares)


def drop_spares() -> int:
    """Drop the spares (a staged turn that never joined: the pool's idle release); their count."""
    with _spares_lock:
        count = len(_spares)
        _spares.clear()
    return count


def joint(shape: tuple[int, int, int, int], dtype: Any) -> mx.array:
    """A zero buffer of at least ``shape``: a spare made ahead if one fits (taken out of the
    registry, so the join's writes are its only reference and land in place), else a new one.
    A spare fits at most twice as wide as needed: an unrelated short join beside a staged turn
    does not take (and hold) the staged turn's wide buffers."""
    rows, heads, width, dim = shape
    with _spares_lock:
        for i, spare in enumerate(_spares):
            if (spare.dtype == dtype and int(spare.shape[0]) == rows and int(spare.shape[1]) == heads
                    and int(spare.shape[3]) == dim and width <= int(spare.shape[2]) <= 2 * width):
                return _spares.pop(i)
    return mx.zeros(shape, dtype=dtype)
