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

The spares count in the runtime's RAM budget (``budget``, its ``LineageCache``): each set is a
``RESERVED`` hold of its own owner (``SPARES_KEY``, in ``budgets()``' ``loading_bytes`` and
``ram_used``), reserved before its buffers are made (the budget makes room first) and let go when
the join has taken the last of them, or when they are dropped or replaced.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import count as counter
from typing import Hashable, Iterable, Iterator, Optional, Protocol, Sequence

import mlx.core as mx

from server_patch.copyfree import pool


SPARES_KEY = "joint spares"  # the RESERVED hold's key in the RAM budget


class Budget(Protocol):
    """What counts the spares in the RAM budget (``LineageCache.reserve``/``release``)."""

    def reserve(self, owner: Hashable, key: str, nbytes: int) -> None: ...

    def release(self, owner: Hashable, kinds: Iterable[str] | None = None) -> int: ...


_sets = counter(1)


class JointSpares:
    """One runtime's joint batch buffers made ahead (the latest staging's), counted in
    ``budget`` (its RAM budget; None: counted nowhere, as in a bench)."""

    def __init__(self, budget: Optional[Budget] = None) -> None:
        self._lock = threading.Lock()
        self._spares: list[mx.array] = []
        self.budget = budget
        self._owner: Optional[Hashable] = None  # the budget's owner of the current set

    def reserve(self, buffers: Sequence[mx.array], rows: int = 2) -> None:
        """Zero buffers of ``rows`` rows shaped like each of ``buffers`` (a staged row's KV
        children, ``[1, heads, capacity, dim]``), evaluated here, off the generation thread: the
        joint batch the staged row's join will write into. Its pages are touched now, so the join
        writes the long row's tokens into memory already mapped instead of allocating (and
        faulting in) a buffer of the joint batch's size on the generation thread. Replaces the
        spares of an earlier staging; ``drop_if_idle`` drops any a join never took."""
        shapes = [((rows, *b.shape[1:]), b.dtype) for b in buffers]
        owner = ("joint spares", next(_sets))
        self._let_go(self._swap([], None))  # the earlier set's bytes leave the budget first
        if self.budget is not None:  # counted before it exists: the budget makes room for it
            self.budget.reserve(owner, SPARES_KEY, sum(_nbytes(shape, dtype) for shape, dtype in shapes))
        made = [mx.zeros(shape, dtype=dtype) for shape, dtype in shapes]
        mx.eval(made)
        self._let_go(self._swap(made, owner))

    def _swap(self, made: list[mx.array], owner: Optional[Hashable]) -> Optional[Hashable]:
        """``made`` (of ``owner``) are the spares now; the owner of those they replaced."""
        with self._lock:
            self._spares[:] = made
            earlier, self._owner = self._owner, owner
        return earlier

    def _let_go(self, owner: Optional[Hashable]) -> None:
        """A set's hold in the budget let go (outside ``_lock``: the budget takes its own)."""
        if owner is not None and self.budget is not None:
            self.budget.release(owner)

    def held_bytes(self) -> int:
        """The bytes of the spares held now."""
        with self._lock:
            return sum(int(s.nbytes) for s in self._spares)

    def count(self) -> int:
        with self._lock:
            return len(self._spares)

    def drop(self) -> int:
        """Drop the spares (a staged turn that never joined); their count."""
        with self._lock:
            count = len(self._spares)
        self._let_go(self._swap([], None))
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

    def take(self, shape: tuple[int, int, int, int], dtype: mx.Dtype) -> mx.array:
        """A zero buffer of at least ``shape``: a spare made ahead if one fits (taken out of the
        list, so the join's writes are its only reference and land in place), else a new one.
        A spare fits at most twice as wide as needed: an unrelated short join beside a staged
        turn does not take (and hold) the staged turn's wide buffers. The join that takes the
        last of a set lets its budget hold go (the buffers are the decoding batch's from then on,
        which the budget does not count; a set taken in part stays counted whole until dropped)."""
        rows, heads, width, dim = shape
        taken, emptied = None, None
        with self._lock:
            for i, spare in enumerate(self._spares):
                if (spare.dtype == dtype and int(spare.shape[0]) == rows and int(spare.shape[1]) == heads
                        and int(spare.shape[3]) == dim and width <= int(spare.shape[2]) <= 2 * width):
                    taken = self._spares.pop(i)
                    if not self._spares:
                        emptied, self._owner = self._owner, None
                    break
        self._let_go(emptied)
        return taken if taken is not None else mx.zeros(shape, dtype=dtype)


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


def _nbytes(shape: Sequence[int], dtype: mx.Dtype) -> int:
    size = int(dtype.size)
    for n in shape:
        size *= int(n)
    return size


def buffer(spares: JointSpares | None, shape: tuple[int, int, int, int], dtype: mx.Dtype) -> mx.array:

    """A zero buffer of at least ``shape``: one of ``spares`` if one fits, else a new one."""
    return spares.take(shape, dtype) if spares is not None else mx.zeros(shape, dtype=dtype)
