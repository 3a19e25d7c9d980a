"""Zero-filled joint batch buffers made ahead, off the generation thread (issue 40).

A turn whose restore is staged (``merge.stage_rows``) will join the decoding batch once its
suffix is prefilled. ``JointSpares.reserve`` makes the zero buffers of that 2-row joint batch
there, so ``batch.extend_kv`` (through ``JointSpares.take``) writes the rows into pages already
mapped instead of allocating, and faulting in, a buffer of the joint batch's size on the
generation thread. Only the latest staging's spares are kept; once the buffer pool has been idle
(``pool.idle``) the runtime's ticker drops any a join never took (``drop_if_idle``).

The spares are a runtime's own (``LineageRuntime.spares``, issue 35): its stager makes them, and
its generator's join takes them. mlx-vlm's ``BatchKVCache.extend`` has no runtime in scope, so
the door names the joining generator's spares for the length of its ``_extend_generation_batch``
(``joining``) and hands them to the join (``of_this_join``): a context variable set and reset
around one call on the generation thread, which no other thread and no later call sees.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Sequence

import mlx.core as mx

from server_patch.copyfree import pool


class JointSpares:
    """One runtime's joint batch buffers made ahead (the latest staging's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spares: list[mx.array] = []

    def reserve(self, buffers: Sequence[mx.array], rows: int = 2) -> None:
        """Zero buffers of ``rows`` rows shaped like each of ``buffers`` (a staged row's KV
        children, ``[1, heads, capacity, dim]``), evaluated here, off the generation thread: the
        joint batch the staged row's join will write into. Its pages are touched now, so the join
        writes the long row's tokens into memory already mapped instead of allocating (and
        faulting in) a buffer of the joint batch's size on the generation thread. Replaces the
        spares of an earlier staging; ``drop_if_idle`` drops any a join never took."""
        made = [mx.zeros((rows, *b.shape[1:]), dtype=b.dtype) for b in buffers]
        mx.eval(made)
        with self._lock:
            self._spares[:] = made

    def count(self) -> int:
        with self._lock:
            return len(self._spares)

    def drop(self) -> int:
        """Drop the spares (a staged turn that never joined); their count."""
        with self._lock:
            count = len(self._spares)
            self._spares.clear()
        return count

    def drop_if_idle(self, now: float | None = None) -> int:
        """Drop the spares once the buffer pool is idle (``pool.idle``), and give their pages
        back with the pool's (``mx.clear_cache``: the pool's own idle release may have run
        already); the count dropped. The runtime's ticker calls it."""
        if not self.count() or not pool.idle(now):
            return 0
        dropped = self.drop()
        if dropped:
            mx.clear_cache()
        return dropped

    def take(self, shape: tuple[int, int, int, int], dtype: Any) -> mx.array:
        """A zero buffer of at least ``shape``: a spare made ahead if one fits (taken out of the
        list, so the join's writes are its only reference and land in place), else a new one.
        A spare fits at most twice as wide as needed: an unrelated short join beside a staged
        turn does not take (and hold) the staged turn's wide buffers."""
        rows, heads, width, dim = shape
        with self._lock:
            for i, spare in enumerate(self._spares):
                if (spare.dtype == dtype and int(spare.shape[0]) == rows and int(spare.shape[1]) == heads
                        and int(spare.shape[3]) == dim and width <= int(spare.shape[2]) <= 2 * width):
                    return self._spares.pop(i)
        return mx.zeros(shape, dtype=dtype)


# The joining generator's spares, for the length of one ``_extend_generation_batch`` on its
# thread (``joining``); None outside one: a join then allocates its buffer.
_JOINING: ContextVar[JointSpares | None] = ContextVar("apc_joining_spares", default=None)


@contextmanager
def joining(spares: JointSpares | None) -> Iterator[None]:
    """Within this block, on this thread, the join's spares are ``spares`` (its runtime's)."""
    token = _JOINING.set(spares)
    try:
        yield
    finally:
        _JOINING.reset(token)


def of_this_join() -> JointSpares | None:
    """The spares ``joining`` named for the join running on this thread, if any."""
    return _JOINING.get()


def buffer(spares: JointSpares | None, shape: tuple[int, int, int, int], dtype: Any) -> mx.array:
    """A zero buffer of at least ``shape``: one of ``spares`` if one fits, else a new one."""
    return spares.take(shape, dtype) if spares is not None else mx.zeros(shape, dtype=dtype)
