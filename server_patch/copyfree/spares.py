"""Zero-filled joint batch buffers made ahead, off the generation thread (issue 40).

A turn whose restore is staged (``merge.stage_rows``) will join the decoding batch once its
suffix is prefilled. ``JointSpares.reserve`` makes the zero buffers of that 2-row joint batch
there, so ``batch.extend_kv`` (through ``JointSpares.take``) writes the rows into pages already
mapped instead of allocating, and faulting in, a buffer of the joint batch's size on the
generation thread. Only the latest staging's spares are kept; once the buffer pool has been idle
(``pool.idle``) the runtime's ticker drops any a join never took (``drop_if_idle``).

A decoding batch's regrow gets its set the same way from a runtime's second instance
(``copyfree.grow``, ``integration.grows_ahead``), named for each decode step (``GROWS``).

Every other join gets its set the same way once its shapes are known: when a prompt batch (a
lent or cold joiner, a mixed batch, a third row, a decoding row wider than the joiner) starts
prefilling while rows decode, ``ahead`` is asked its join's shapes (``batch.joint_shapes``, on
the generation thread: a few integers per layer) and the stager ``make``s them
(``integration.joins_ahead``), replacing a set held unless that one fits already (a staged
turn's). Until that join (``joined``, the door's, after every join) a staging's 2-row guess does
not replace it; a set made after its join came (the join allocated: its suffix prefill was
shorter than the making), or one its join did not fit (a row left meanwhile), is let go. The
"at most twice as wide" rule of ``take`` holds for these sets too: their width is an upper
bound at most a step or so past the join's need, for up to one allocation step (256) of decode
steps during the prefill. Measured (docs/benchmarks.md, bench preset, 8k tokens): a lent
joiner's join 38 ms against 641 ms allocating at the join (``bench copies``); in ``bench stall``
``ram-lent`` the victim waited 43 ms at that join, against 660 ms with mlx-vlm's ``extend``.

The spares are a runtime's own (``LineageRuntime.spares``, issue 35): its stager makes them, and
its generator's join takes them. mlx-vlm's ``BatchKVCache.extend`` has no runtime in scope, so
the door names the joining generator's spares for the length of its ``_extend_generation_batch``
(``joining``) and hands them to the join (``of_this_join``): a context variable set and reset
around one call on the generation thread, which no other thread and no later call sees.

The spares count in the runtime's RAM budget (``budget``, its ``LineageCache``): each set is a
``RESERVED`` hold of its own owner (``SPARES_KEY``, in ``budgets()``' ``loading_bytes`` and
``ram_used``), reserved before its buffers are made, only in the budget's free room
(``LineageCache.reserve_spare``: a set never evicts a cached entry nor takes the budget past its
limit; where it does not fit, none is made and the join allocates), and let go when the join has
taken the last of them, or when they are dropped or replaced.
"""

from __future__ import annotations

import logging
import threading
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import count as counter
from typing import Callable, Hashable, Iterable, Iterator, Optional, Protocol, Sequence

import mlx.core as mx

from server_patch.copyfree import pool


log = logging.getLogger("server_patch.copyfree")
SPARES_KEY = "joint spares"  # the RESERVED hold's key in the RAM budget
Shape = tuple[tuple[int, ...], mx.Dtype]  # one joint buffer: its shape and dtype


class Budget(Protocol):
    """What counts the spares in the RAM budget (``LineageCache.reserve_spare``/``release``)."""

    def reserve_spare(self, owner: Hashable, key: str, nbytes: int) -> bool: ...

    def release(self, owner: Hashable, kinds: Iterable[str] | None = None) -> int: ...


_sets = counter(1)


class JointSpares:
    """One runtime's joint batch buffers made ahead (the latest staging's, or the set asked for
    the next join's known shapes), counted in ``budget`` (its RAM budget; None: counted nowhere,
    as in a bench)."""

    def __init__(self, budget: Optional[Budget] = None, purpose: str = "join") -> None:
        self.purpose = purpose  # what takes them, for the log: a ``join``, a ``regrow``
        self._lock = threading.Lock()
        self._spares: list[mx.array] = []
        self.budget = budget
        self._owner: Optional[Hashable] = None  # the budget's owner of the current set
        # The prompt batch whose join's set is asked for (``ahead``) and that set's ticket, until
        # a join (``joined``): staging's guesses stay out meanwhile, and a set made after its
        # join is let go at once.
        self._joiner: Optional[weakref.ref[object]] = None
        self._ticket: Optional[int] = None
        self._taken = 0  # buffers joins took since the last ``joined``
        self._making: Optional[int] = None  # the ticket whose set the stager is making now
        # When the join asked for began waiting for its set (``joins_ahead.waits``), until it joins.
        self.waiting_since: Optional[float] = None

    def reserve(self, buffers: Sequence[mx.array], rows: int = 2) -> None:
        """Zero buffers of ``rows`` rows shaped like each of ``buffers`` (a staged row's KV
        children, ``[1, heads, capacity, dim]``), evaluated here, off the generation thread: the
        joint batch the staged row's join will write into. Its pages are touched now, so the join
        writes the long row's tokens into memory already mapped instead of allocating (and
        faulting in) a buffer of the joint batch's size on the generation thread. Replaces the
        spares of an earlier staging; ``drop_if_idle`` drops any a join never took."""
        shapes: list[Shape] = [((rows, *b.shape[1:]), b.dtype) for b in buffers]
        with self._lock:
            if self._ticket is not None:  # a known join's set is asked for: it is that join's shape
                return
        self._make(shapes, (SPARES_KEY, next(_sets)), None)

    def asked(self, joiner: object) -> bool:
        """Whether ``ahead`` was asked for ``joiner``'s join already (and it has not joined)."""
        with self._lock:
            return self._joiner is not None and self._joiner() is joiner

    def ahead(self, joiner: object, shapes: Sequence[Shape]) -> Optional[int]:
        """On the generation thread, when a prompt batch (``joiner``) starts prefilling while
        rows decode: its join's buffers will have ``shapes`` (``batch.joint_shapes``). The
        ticket for ``make`` (to run off the thread), or None where the set held fits them all
        already (a staged turn's) or nothing is to be made."""
        with self._lock:
            self._joiner, self._ticket = weakref.ref(joiner), next(_sets)
            self.waiting_since = None  # a new joiner: an earlier one's wait (it was cancelled) is over
            if not shapes or self._fits_all(shapes):
                return None
            return self._ticket

    def ask(self, owner: object, shapes: Sequence[Shape], run: Callable[..., object]) -> bool:
        """``ahead`` on the generation thread, and its ``make`` handed to ``run`` (the runtime's
        stager's: off the thread). Whether a job was handed."""
        ticket = self.ahead(owner, shapes)
        if ticket is None:
            return False
        with self._lock:
            self._making = ticket
        run(self.make, ticket, shapes)
        return True

    def unmade(self, owner: object) -> bool:
        """Whether the set asked for ``owner`` is still being made (handed to the stager by
        ``ask``, not finished nor given up)."""
        with self._lock:
            return (self._making is not None and self._making == self._ticket and self._joiner is not None
                    and self._joiner() is owner)

    def make(self, ticket: int, shapes: Sequence[Shape]) -> bool:
        """Off the generation thread (the runtime's stager): the zero buffers ``ahead`` asked
        for under ``ticket``, evaluated, replacing the set held; nothing where that join has
        happened meanwhile or a later one asked (its bytes let go at once if that happened
        while they were made). Whether they are held now."""
        with self._lock:
            if ticket != self._ticket:
                return False
        try:
            return self._make(shapes, (SPARES_KEY, ticket), ticket)
        finally:
            with self._lock:
                if self._making == ticket:
                    self._making = None

    def joined(self) -> int:
        """After a join (taking what fits): the set asked for it is spent, and what it left
        (it fit no buffer: a row left the batch meanwhile, or a prefill outran its estimate)
        is dropped; a staged turn's set is kept for its own join. The count dropped."""
        with self._lock:
            ticket, self._ticket, self._joiner = self._ticket, None, None
            self._making = self.waiting_since = None
            taken, self._taken = self._taken, 0
            spent = ticket is not None and self._owner == (SPARES_KEY, ticket)
            count = len(self._spares) if spent else 0
        if spent:
            self._let_go(self._swap([], None))
        if taken or count:
            log.info("apc_copyfree %s: %d buffers made ahead taken, %d left over dropped", self.purpose, taken, count)
        return count

    def _make(self, shapes: Sequence[Shape], owner: Hashable, ticket: Optional[int]) -> bool:
        self._let_go(self._swap([], None))  # the earlier set's bytes leave the budget first
        nbytes = sum(_nbytes(shape, dtype) for shape, dtype in shapes)
        if self.budget is not None and not self.budget.reserve_spare(owner, SPARES_KEY, nbytes):
            # Counted before it exists, and only in the budget's free room: a set never evicts a
            # cached entry nor takes the budget past its limit; without one the join allocates.
            log.info("apc_copyfree %s buffers not made ahead: %d bytes do not fit the RAM budget's free room",
                     self.purpose, nbytes)
            return False
        made = [mx.zeros(shape, dtype=dtype) for shape, dtype in shapes]
        mx.eval(made)
        with self._lock:
            late = ticket is not None and ticket != self._ticket
        if late:  # its join came first (it allocated): these would fit no other
            self._let_go(owner)
            return False
        self._let_go(self._swap(made, owner))
        return True

    def _fits_all(self, shapes: Sequence[Shape]) -> bool:
        """Under ``_lock``: each of ``shapes`` has a buffer of its own in the set held."""
        free = list(self._spares)
        for shape, dtype in shapes:
            found = next((i for i, spare in enumerate(free) if _fits(spare, shape, dtype)), None)
            if found is None:
                return False
            free.pop(found)
        return True

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
        taken = self.taken(shape, dtype)
        return taken if taken is not None else mx.zeros(shape, dtype=dtype)

    def taken(self, shape: tuple[int, int, int, int], dtype: mx.Dtype) -> Optional[mx.array]:
        """``take``'s spare, or None where none fits (the caller allocates as it likes)."""
        taken, emptied = None, None
        with self._lock:
            for i, spare in enumerate(self._spares):
                if _fits(spare, shape, dtype):
                    taken = self._spares.pop(i)
                    self._taken += 1
                    if not self._spares:
                        emptied, self._owner = self._owner, None
                    break
        self._let_go(emptied)
        return taken


class Named:
    """Spares named for the length of one call on this thread (``naming``), for code inside it
    that has no runtime in scope (mlx-vlm's cache methods); None outside such a call."""

    def __init__(self, name: str) -> None:
        self._var: ContextVar[JointSpares | None] = ContextVar(name, default=None)

    @contextmanager
    def naming(self, spares: JointSpares | None) -> Iterator[None]:
        """Within this block, on this thread, the spares are ``spares`` (a runtime's)."""
        token = self._var.set(spares)
        try:
            yield
        finally:
            self._var.reset(token)

    def get(self) -> JointSpares | None:
        return self._var.get()


# The joining generator's spares, for the length of one ``_extend_generation_batch`` (a join
# outside one allocates its buffer), and the decoding batch's regrow spares for the length of
# one decode step (``copyfree.grow``).
JOINS = Named("apc_joining_spares")
GROWS = Named("apc_growing_spares")
joining, of_this_join = JOINS.naming, JOINS.get


def _fits(spare: mx.array, shape: Sequence[int], dtype: mx.Dtype) -> bool:
    """``spare`` serves a join needing ``shape``: the same rows, heads and dim, and a width from
    the one needed to twice it (an unrelated short join leaves a long turn's buffer alone)."""
    rows, heads, width, dim = (int(n) for n in shape)
    return (spare.dtype == dtype and int(spare.shape[0]) == rows and int(spare.shape[1]) == heads
            and int(spare.shape[3]) == dim and width <= int(spare.shape[2]) <= 2 * width)


def _nbytes(shape: Sequence[int], dtype: mx.Dtype) -> int:
    size = int(dtype.size)
    for n in shape:
        size *= int(n)
    return size


def buffer(spares: JointSpares | None, shape: tuple[int, int, int, int], dtype: mx.Dtype) -> mx.array:
    """A zero buffer of at least ``shape``: one of ``spares`` if one fits, else a new one."""
    return spares.take(shape, dtype) if spares is not None else mx.zeros(shape, dtype=dtype)
