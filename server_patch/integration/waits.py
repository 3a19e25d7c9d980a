"""How long each request waited for another request's work on the one generation thread.

mlx-vlm 0.7.10 serves every row from one generation thread: while it prefills a chunk of one
prompt, restores (looks up and merges) another's KV, or commits a third's entry, every other
row stands still (issue 29). Each such unit of work is timed once (``clock.monotonic``) and
its time is charged to every *other* live row (admitted, prefilling or decoding) as waited-for
time, by what the work was (``Work``), on the row's timing record (``RequestTiming.waited``,
``waited_ms``, ``delayed_steps``: decode steps of its own the work pushed back). A row's waits
keep accruing past its first token (most of a stream's stalls come while it decodes) until the
row ends, when its record is final (``TimingBook.ended``: ``/admin/requests`` and the event
stream's ``request_ended``).

A unit opened inside another (a prompt-end commit inside the prefill chunk that reached it, a
commit a lookup's sweep made) is charged as its own work, and the outer unit only for the rest.
Each unit costs one pass over the book's rows and O(1) per row: no array is touched, so the
cache's work on the generation thread stays O(metadata). Queued prompts mlx-vlm has not looked
up yet (and rows LOADING their disk file, whose wait is ``loading_ms``) have no record to
charge. A prefill chunk is timed to the end of its compute only while decode-aware prefill
paces it (``server_patch.pacing`` synchronizes then); with ``APC_DECODE_STALL_MS=0`` a chunk is
timed to its dispatch, and its compute is waited for in the next decode step, uncharged.

A decoding row's inter-token gaps (issue 40): every unit charged to it also goes on the gap it
is in, the joint decode step (``hooks.decode_step``) as its own ``step``, and when a step gives it
its token (``close_gaps``) the gap since its previous one closes with the rest ``unattributed``
(the loop, the server's queues): the parts add up to the gap (``RequestTiming.close_gap``). Each
unit that follows a decode step first waits for the step's pending compute as ``step``
(``hooks._settle``: mlx-vlm dispatches a step's successor before returning its tokens), so a
join (``hooks.batch_join``, timed to its joined caches computed), a leave (``hooks.rows_leave``)
or a paced prefill chunk times only its own work.

The work units are declared where the work is (``unit`` decorators: ``hooks.prefill_step``,
``LineageCoordinator.lookup``, ``BatchRows.merge`` / ``prefill_end`` / ``commit``; ``run`` for the
disk load inside a lookup), each with an ``owners`` function (below, and the door's
``hooks._prefilling``) that names the waits book and the rows whose work it is.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, ParamSpec, Sequence, TypeVar, cast

from server_patch import clock

if TYPE_CHECKING:
    from server_patch.integration.batch_rows import BatchRows
    from server_patch.integration.coordinator import LineageCoordinator
    from server_patch.integration.pending import RequestKey
    from server_patch.integration.session import SessionBook, Session

log = logging.getLogger("server_patch.lineage")

F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")


class Work(StrEnum):
    """What another request's work on the generation thread was (the keys of ``waited``)."""

    PREFILL = "prefill"  # a chunk of its prompt (``hooks.prefill_step``)
    RESTORE = "restore"  # its lookup (planning, building the restored views) and its merge copy
    COMMIT = "commit"  # its entry committed: at its prompt end, past its reply, at a join or a lookup's sweep
    LOAD = "load"  # a disk file read on the generation thread at its lookup (not prefetched)
    JOIN = "join"  # its finished prompt batch joined the decoding batch (``GenerationBatch.extend``)
    LEAVE = "leave"  # its rows left the decoding batch (``GenerationBatch.filter``, its reply commit inside)
    STAGE = "stage"  # the queue's turn: its disk load or staged copy started or checked (``prefetch``, ``admissible``)
    POOL = "pool"  # the buffer pool cleared (``mx.clear_cache``, ``APC_POOL_CLEAR=1``)
    GROW = "grow"  # the decoding batch's KV outgrew its buffer: every row copied (``copyfree.grow``)


WORK_KINDS = tuple(Work)
# A decoding row's inter-token gap (``RequestTiming.worst_gap`` / ``gaps``) is split into the
# ``Work`` done for others, its own share of the joint decode step, and what no unit timed.
OWN_STEP = "step"  # the decode step every decoding row shares (``GenerationBatch.next``)
UNATTRIBUTED = "unattributed"  # the gap less every timed part: the loop, the server's queues
GAPS_KEPT = 8  # a record keeps its largest gaps that held others' work, largest first


@dataclass(frozen=True)
class Owners:
    """The rows whose work a unit is (never charged for it): by request key (looked up in the
    book when the unit ends: a lookup's row exists only then), uid, or the row itself."""

    keys: tuple[RequestKey, ...] = ()
    uids: tuple[int, ...] = ()
    rows: tuple[Session, ...] = ()

    def resolve(self, book: "SessionBook") -> set[int]:
        """The ``id`` of each owning row (O(owners): the rows are never hashed by their tokens)."""
        found = [*self.rows, *(book.by_key(key) for key in self.keys), *(book.by_uid(uid) for uid in self.uids)]
        return {id(row) for row in found if row is not None}


@dataclass
class _Unit:
    waits: "Waits"
    kind: str
    owners: Owners
    started: float
    inner: float = 0.0  # seconds of units opened inside it (charged as their own work)
    cut: float = 0.0  # seconds of it already charged at a gap's end (``close_gaps``)


_OPEN = threading.local()  # the units open on this thread, innermost last (``_OPEN.units``)


def _stack() -> list[_Unit]:
    units = getattr(_OPEN, "units", None)
    if units is None:
        units = _OPEN.units = []
    return units


# The ``SessionState`` values of rows another's work holds up, and of those decoding (by value:
# ``session`` builds its book's ``Waits``, so this module imports nothing of it).
HELD_UP = frozenset({"admitted", "prefilling", "decoding"})
DECODING = "decoding"


class Waits:
    """The waits of one ``SessionBook``'s rows: work units charged to the rows they held up."""

    def __init__(self, book: "SessionBook") -> None:
        self.book = book

    def begin(self, kind: str, owners: Owners) -> None:
        """A unit of ``owners``' work starts on this thread (``end`` closes it)."""
        _stack().append(_Unit(self, str(kind), owners, clock.monotonic()))

    def end(self) -> None:
        """The innermost unit this thread opened is over: its time (less its inner units')
        is charged to the other live rows."""
        units = _stack()
        unit = units.pop()
        elapsed = clock.monotonic() - unit.started
        if units:
            units[-1].inner += elapsed + unit.cut
        try:
            self.charge(unit.kind, max(0.0, elapsed - unit.inner), unit.owners)
        except Exception as exc:  # a wait record must never fail the generation thread
            log.debug("apc_lineage waits: %s not charged: %s", unit.kind, exc)

    def charge(self, kind: str, seconds: float, owners: Owners) -> None:
        """``seconds`` of ``owners``' ``kind`` of work: every other live row with a record
        waited that long, and a decoding one had a decode step pushed back (counted once per
        step, however many units came between two steps)."""
        if seconds <= 0:
            return
        ms, step, owning = seconds * 1000, self.book.decode_steps, owners.resolve(self.book)
        for row in self.book.rows():
            record = row.record
            if record is None or row.state not in HELD_UP or id(row) in owning:
                continue
            if row.state == DECODING:
                record.gap_parts = {**record.gap_parts, kind: record.gap_parts.get(kind, 0.0) + ms}
            if kind == OWN_STEP:  # its own step: part of its gaps, never a wait for another
                continue
            record.waited_ms += ms
            # Copied, never changed in place: a server thread may be serializing the record.
            record.waited = {**record.waited, kind: record.waited.get(kind, 0.0) + ms}
            if row.state == DECODING and record.delay_mark != step:
                record.delay_mark = step
                record.delayed_steps += 1

    @contextlib.contextmanager
    def timed(self, kind: str, owners: Owners) -> Iterator[None]:
        """The ``with`` body is one unit of ``owners``' ``kind`` of work (``begin`` ... ``end``)."""
        self.begin(kind, owners)
        try:
            yield
        finally:
            self.end()

    def close_gaps(self, uids: Sequence[int]) -> None:
        """Rows ``uids`` just got their tokens of a decode step: the step so far is charged as
        their own (the rest of it, a leaving row's filter say, falls in their next gap), and each
        decoding row's gap since its previous token ends, split into what was charged to it
        meanwhile and what no unit timed (``RequestTiming.close_gap``). O(rows), no array read."""
        now = clock.monotonic()
        units = _stack()
        if units and units[-1].kind == OWN_STEP and units[-1].waits is self:
            step = units[-1]
            spent = max(0.0, now - step.started - step.inner)
            step.cut += now - step.started
            step.started, step.inner = now, 0.0
            self.charge(OWN_STEP, spent, Owners())
        for uid in uids:
            row = self.book.by_uid(uid)
            if row is not None and row.record is not None and row.state == DECODING:
                row.record.close_gap(now)

    def ended(self, row: "Session") -> None:
        """``row`` ended: nothing more holds it up, its record's waits are final."""
        if row.record is not None:
            self.book.timings.ended(row.record)


def run(kind: str, call: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``call(*args, **kwargs)`` as a unit of ``kind`` inside the unit open on this thread, for
    its owners (a disk load inside a lookup is ``load``, not ``restore``); untimed when none is open."""
    units = _stack()
    if not units:
        return call(*args, **kwargs)
    parent = units[-1]
    with parent.waits.timed(kind, parent.owners):
        return call(*args, **kwargs)


def unit(kind: Work, owners: Callable[..., tuple[Optional[Waits], Owners]]) -> Callable[[F], F]:
    """A function whose every call is a unit of ``kind``: ``owners(*args, **kwargs)`` names
    the waits book (None: not timed, a stock coordinator's) and whose work it is. A failure to
    name them never fails the call."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            try:
                waits, whose = owners(*args, **kwargs)
            except Exception as exc:
                log.debug("apc_lineage waits: %s not timed: %s", function.__name__, exc)
                waits = None
            if waits is None:
                return function(*args, **kwargs)
            with waits.timed(kind, whose):
                return function(*args, **kwargs)

        return cast(F, timed)  # the same signature: ``functools.wraps`` of ``function``

    return decorate


# ---------------------------------------------------------------------- whose work each unit is


def lookup(coordinator: LineageCoordinator, token_ids: Sequence[int], *, extra_hash: int,
           uid: Optional[int] = None, **_: object) -> tuple[Optional[Waits], Owners]:
    """``LineageCoordinator.lookup``: the looked-up request's restore (its row by ``uid``; one
    with none, the single-sequence path's, by its request key)."""
    from server_patch.integration.pending import namespace_of, request_key
    from server_patch.lineage import as_tokens

    if coordinator.lineage is None:  # stock APC's (block mode, APC off)
        return None, Owners()
    if uid is not None:
        return coordinator.lineage.book.waits, Owners(uids=(uid,))
    return coordinator.lineage.book.waits, Owners(keys=(request_key(namespace_of(extra_hash), as_tokens(token_ids)),))


def merged_rows(batch_rows: BatchRows, found: Sequence[Optional[Session]], *_: object,
                **__: object) -> tuple[Optional[Waits], Owners]:
    """``BatchRows.merge(rows, ...)``: the merged rows' restore copy."""
    return batch_rows.book.waits, Owners(rows=tuple(r for r in found if r is not None))


def one_row(batch_rows: BatchRows, row: Session, *_: object, **__: object) -> tuple[Optional[Waits], Owners]:
    """``BatchRows.prefill_end(row, ...)`` / ``commit(row, ...)``: that row's commit."""
    return batch_rows.book.waits, Owners(rows=(row,))


__all__ = ["GAPS_KEPT", "OWN_STEP", "UNATTRIBUTED", "WORK_KINDS", "Owners", "Waits", "Work", "lookup",
           "merged_rows", "one_row", "run", "unit"]
