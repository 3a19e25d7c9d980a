"""One session per request, from the queue or its lookup to its last event: the row machine.

Everything the cache knows about one request is one ``Session``: its prompt between lookup and
prefill end with its one admission (``pending``, ``Pending.admission``), the loan of an entry's
buffer (``loan``), its deferred commit (``deferral``), the reply it is being fed (``reply``), its
timing record (``record``; finished records go to the runtime's ring, ``TimingBook``), and where
it is (``state``). What it holds of the cache is holds it owns (``lineage.holds``), let go when
the book forgets it (``release``). One bounded ``SessionBook`` holds them, each by mlx-vlm's uid
from the queue (a LOADING or STAGING row) or its lookup (the ``lookup`` edit passes the uid) to
its end; the HTTP request id is a field (``request_id``), set by the server's events. Identical
prompts are rows of their own, with their own replies (issue 35: keyed by their tokens, twins
admitted in one prompt batch were one row, and one twin's reply was another's). Only a prompt no
queue named (the single-sequence path) is found by its request key until a store names its uid.

Every mlx-vlm event is one transition (``SessionState``, the diagram in docs/architecture.md):

    LOADING --loaded, failed or past the bound--> ADMITTED
    LOADING --loaded while others decode, its copy stageable--> STAGING
    STAGING --staged, failed or past the bound--> ADMITTED
    ADMITTED --bind--> PREFILLING --store at the prefill end--> DECODING --leaving--> ENDED
    (a resend has nothing to prefill: bound and at its prefill end at once; ``removed`` ends a
    row wherever it is; the single-sequence path, with no uid, ends at its prefill end; a
    request whose restore point is on disk waits in LOADING, still in mlx-vlm's queue, while
    its file loads on the loader thread, ``integration.loading``; one whose RAM restore would
    take the merge copy waits in STAGING while its rows are copied on the stager thread,
    ``integration.staging``; one that leaves the queue meanwhile, cancelled, ends there)

A transition the table does not allow fails closed (``server_patch.failclosed``): the row
keeps its state, and under ``APC_TEST_FAULTS=1`` the error is raised. To add a state, add it
to ``SessionState`` and ``_NEXT``.
What happens to the buffers at each transition is ``integration.batch_rows``; the mechanics
(lend, adopt, validate) are ``server_patch.copyfree``'s functions over these fields.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from server_patch.failclosed import fail_closed
from server_patch.integration.pending import Pending, PromptKey, prompt_key
from server_patch.integration.timings import DECODE, PREFILL, RequestTiming, TimingBook
from server_patch.integration.waits import Waits

if TYPE_CHECKING:
    from server_patch.copyfree.deferred import Deferred
    from server_patch.copyfree.lease import Lease
    from server_patch.copyfree.replies import Reply
    from server_patch.integration.loading import Load
    from server_patch.integration.staging import Stage

log = logging.getLogger("server_patch.lineage")

ROWS_MAX = 512  # rows kept; the oldest without a loan or a deferral are forgotten first


class SessionState(StrEnum):
    """Where a request is, as far as its KV rows go."""

    LOADING = "loading"  # queued, its restore point's disk file loading off the generation thread
    STAGING = "staging"  # queued, its RAM restore's rows copied off the generation thread
    ADMITTED = "admitted"  # looked up (or planned cold without a lookup): named by its key
    PREFILLING = "prefilling"  # bound to the generator's uid, its prompt being prefilled
    DECODING = "decoding"  # past its prefill end: its entry committed or deferred
    ENDED = "ended"  # left the batch or was removed: nothing of it writes a cache any more


WAITING = frozenset({SessionState.LOADING, SessionState.STAGING})  # queued, waiting for off-thread work

_NEXT: dict[SessionState, frozenset[SessionState]] = {
    SessionState.LOADING: frozenset({SessionState.STAGING, SessionState.ADMITTED, SessionState.ENDED}),
    SessionState.STAGING: frozenset({SessionState.ADMITTED, SessionState.ENDED}),
    SessionState.ADMITTED: frozenset({SessionState.PREFILLING, SessionState.DECODING, SessionState.ENDED}),
    SessionState.PREFILLING: frozenset({SessionState.DECODING, SessionState.ENDED}),
    SessionState.DECODING: frozenset({SessionState.ENDED}),
    SessionState.ENDED: frozenset(),
}


class SessionStateError(RuntimeError):
    """A row was asked to move where its state does not lead."""


class ScopeClosedError(RuntimeError):
    """A session was asked of a scope whose coordinator is done (``SessionBook.close``)."""


@dataclass(eq=False)
class Session:
    """One request's whole life in the cache: its loan, its deferred prompt-end entry and its
    tracked reply (``copyfree``'s mechanics), its wait in the queue, its timing record."""

    pending: Pending
    record: Optional[RequestTiming] = None
    uid: Optional[int] = None  # mlx-vlm's uid of its sequence (None: the single-sequence path)
    state: SessionState = SessionState.ADMITTED
    loan: Optional[Lease] = None
    deferral: Optional[Deferred] = None
    reply: Optional[Reply] = None
    timed: bool = False  # its record is finished (first token, or cancelled before it)
    seq: int = 0  # the book's order (oldest first)
    history: list[SessionState] = field(default_factory=list)  # the states it left, in order
    load: Optional[Load] = None  # while LOADING and until its lookup
    stage: Optional[Stage] = None  # while STAGING and until its lookup
    staged: bool = False  # its restored caches hold a staged buffer: the merge adopts it, no copy
    scope: object = None  # the book's scope it lives in (``SessionBook.scope``): its uid is unique there
    request_id: object = None  # the HTTP request's id, once the server reports an event of it

    @property
    def key(self) -> PromptKey:
        return self.pending.key

    @property
    def prefilling(self) -> bool:
        """Its prompt is still being prefilled: its captures are taken, its prefill end to come."""
        return self.state in (SessionState.ADMITTED, SessionState.PREFILLING)

    @property
    def over(self) -> bool:
        """Nothing more can happen to it: ended, no loan or deferral left to settle, and its
        record finished or never to be."""
        return (self.state == SessionState.ENDED and self.loan is None and self.deferral is None
                and (self.timed or self.record is None or self.uid is None))

    def move(self, to: SessionState, event: str) -> bool:
        """One transition (``event`` names it in the error); False, failing closed, if illegal."""
        if to == self.state:
            return True
        if to not in _NEXT[self.state]:
            fail_closed(SessionStateError(f"row {self.uid!r} {self.state} -> {to} on {event}"),
                        "apc_lineage row transition", log=log)
            return False
        self.history.append(self.state)
        self.state = to
        return True


class SessionBook:
    """The sessions of one runtime, bounded, each by mlx-vlm's uid from the queue to its end (a
    row of a prompt that has none, the single-sequence path's, by its request key until a
    store or a bind names one), and, as its ring, the finished timing records (``timings``).
    Thread-safe: the generation thread moves rows, the server's threads finish their records.

    The runtime owns one book; each coordinator (one per batch generator, and one per
    single-sequence call, ``hooks.coordinator``) works in a scope of it (``scope``): the same
    sessions, lock, bound, release and ring, but its own uids. mlx-vlm numbers a generator's
    sequences from 0 and the server builds a new generator when an idle one closes, so a uid
    names a session only within its generator's scope; a scope's finders see its own sessions
    (``sessions`` sees them all)."""

    def __init__(self, timings: Optional[TimingBook] = None, limit: int = ROWS_MAX,
                 release: Optional[Callable[[Session], object]] = None) -> None:
        """``timings``: the ring of finished records (a new one by default); ``release``: the
        cache's ``LineageCache.release``, called with a row once it is forgotten (everything its
        request still holds of the cache is let go: the one sweep at a request's end)."""
        self.timings = timings if timings is not None else TimingBook()
        self._release = release
        self._forgotten: list[Session] = []  # forgotten under the lock, released after it (``_let_go``)
        self._rows: OrderedDict[int, Session] = OrderedDict()  # every scope's
        self._by_uid: dict[tuple[object, int], Session] = {}  # by (scope, uid)
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._limit = limit
        self._scope: object = None  # the book's own scope; ``scope()`` makes others
        self._closed = False  # this scope's coordinator is done: no session is added (``close``)
        self.decode_steps = 0  # decode steps seen (``decoded``): how long a LOADING row waited
        self.waits = Waits(self)  # what each row waited for others' work (``integration.waits``)

    def scope(self) -> "SessionBook":
        """A scope of this book for one coordinator: the same sessions, lock, bound, release and
        ring; its own uids, its own rows to find, decode steps and waits."""
        scoped = copy.copy(self)  # shares the containers, the lock and the ring
        scoped._scope = object()
        scoped._closed = False
        scoped.decode_steps = 0
        scoped.waits = Waits(scoped)
        return scoped

    def same_book(self, other: "SessionBook") -> bool:
        """Whether ``other`` is this book or a scope of it."""
        return other._rows is self._rows

    def sessions(self) -> list[Session]:
        """Every session of every scope, oldest first."""
        with self._lock:
            return list(self._rows.values())

    def __len__(self) -> int:
        return len(self.rows())

    def _mine(self) -> list[Session]:
        """This scope's rows, oldest first (under the lock)."""
        return [r for r in self._rows.values() if r.scope is self._scope]

    # ------------------------------------------------------------------ admission and binding

    def loading(self, pending: Pending, load: Load, uid: Optional[int] = None) -> Session:
        """Queued prompt ``uid`` whose restore point's file is loading (``load``): a LOADING row."""
        return self.waiting(pending, SessionState.LOADING, uid, load=load)

    def staging(self, pending: Pending, stage: Stage, uid: Optional[int] = None) -> Session:
        """Queued prompt ``uid`` whose RAM restore's rows are being copied (``stage``): a STAGING row."""
        return self.waiting(pending, SessionState.STAGING, uid, stage=stage)

    def waiting(self, pending: Pending, state: SessionState, uid: Optional[int] = None, *,
                load: Optional[Load] = None, stage: Optional[Stage] = None) -> Session:
        """A queued prompt that waits (``WAITING``) for work done off the generation thread."""
        with self._lock:
            row = self._add(Session(pending, state=state, uid=uid, seq=next(self._seq), scope=self._scope,
                                    load=load, stage=stage))
        self._let_go()
        return row

    def admit(self, pending: Pending, record: Optional[RequestTiming] = None, loan: Optional[Lease] = None,
              uid: Optional[int] = None) -> Session:
        """Looked-up prompt ``uid`` (or one planned cold without a lookup): ADMITTED. Its row
        waiting in the queue is admitted (its load finished, failed or ran past the bound);
        a second lookup of the same uid admits its row again (its plan and record are the new
        lookup's; a loan it holds stays). Identical prompts of other uids are rows of their
        own. Without a uid, an unbound ADMITTED row with the same request key is the one."""
        with self._lock:
            row = self._by_uid.get((self._scope, uid)) if uid is not None else self._unbound(pending.key)
            if row is not None and row.state in WAITING and row.move(SessionState.ADMITTED, "admit"):
                row.load = row.stage = None  # what it loaded is promoted, what it staged taken (or dropped)
            if row is not None and row.state == SessionState.ADMITTED:
                row.pending, row.record = pending, record
                row.loan = row.loan if row.loan is not None else loan
            else:
                row = self._add(Session(pending, record, uid=uid, loan=loan, seq=next(self._seq),
                                        scope=self._scope))
            if record is not None and uid is not None:
                record.uid = uid
        self._let_go()
        return row

    def _add(self, row: Session) -> Session:
        if self._closed:  # its generator is gone: no event of it will ever end this row
            raise ScopeClosedError(f"row {row.uid!r} added to a closed scope")
        self._rows[row.seq] = row
        if row.uid is not None:
            self._by_uid[(row.scope, row.uid)] = row
        self._bound()
        return row

    def _unbound(self, key: Optional[PromptKey]) -> Optional[Session]:
        """The newest row with request ``key`` and no uid (a prompt no queue named)."""
        return next((r for r in reversed(self._mine()) if r.uid is None and r.key == key), None)

    def _bound(self) -> None:
        """Forget the oldest rows past the limit, but none holding a loan or a deferral (those
        end by their own events or a lookup's sweep), nor one waiting in the queue (its staged
        copy holds an entry's receipt until its lookup or its leaving the queue ends it)."""
        excess = len(self._rows) - self._limit
        forgettable = [r for r in self._rows.values()
                       if r.loan is None and r.deferral is None and r.state not in WAITING]
        for row in forgettable[:max(0, excess)]:
            self._drop(row)

    def bind(self, key: PromptKey, uid: int) -> Optional[Session]:
        """Row ``uid`` is in a prompt batch now: PREFILLING. A row admitted without a uid (a
        lookup that had none) with request ``key`` is named ``uid`` here."""
        with self._lock:
            row = self._by_uid.get((self._scope, uid))
            if row is None and (row := self._unbound(key)) is not None and row.state == SessionState.ADMITTED:
                row.uid = uid
                self._by_uid[(self._scope, uid)] = row
            if row is None or row.state != SessionState.ADMITTED:
                return None
            if not row.move(SessionState.PREFILLING, "bind"):
                return None
            if row.record is not None:
                row.record.uid = uid
            return row

    # ------------------------------------------------------------------ finding rows

    def by_key(self, key: PromptKey) -> Optional[Session]:
        """The newest row with request ``key`` (identical prompts are rows of their own: a
        uid names one; this is for a prompt no queue named, and for tests)."""
        with self._lock:
            return next((r for r in reversed(self._mine()) if r.key == key), None)

    def by_uid(self, uid: Optional[int]) -> Optional[Session]:
        if uid is None:  # no row is found by no uid (none is filed under None)
            return None
        with self._lock:
            return self._by_uid.get((self._scope, uid))

    def queued(self, uid: Optional[int], key: Optional[PromptKey]) -> Optional[Session]:
        """The row a lookup of ``uid`` (``key``: its request key) finds already there: the one
        that waited in the queue, or its earlier lookup's; without a uid, an unbound one."""
        with self._lock:
            return self._by_uid.get((self._scope, uid)) if uid is not None else self._unbound(key)

    def rows(self) -> list[Session]:
        """This scope's rows, oldest first."""
        with self._lock:
            return self._mine()

    def lent(self) -> list[Session]:
        return [r for r in self.rows() if r.loan is not None]

    def deferred(self) -> list[Session]:
        return [r for r in self.rows() if r.deferral is not None]

    def replying(self) -> list[Session]:
        return [r for r in self.rows() if r.reply is not None]

    def lent_to(self, key: PromptKey) -> bool:
        """Some row of request ``key`` holds a loan (the same prompt is running on it)."""
        return any(r.key == key for r in self.lent())

    def with_tokens(self, prompt: np.ndarray) -> list[Session]:
        """Prefilling rows with exactly these tokens, whatever their namespace."""
        key = prompt_key(prompt)
        return [r for r in self.rows() if r.prefilling and r.key[1:] == key
                and np.array_equal(r.pending.tokens, prompt)]

    def matching(self, prefix: np.ndarray, namespace: str) -> list[Session]:
        """Prefilling rows of ``namespace`` that start with ``prefix`` and want a state at its
        length; a row without a namespace (it skipped lookup) takes this one."""
        length = int(prefix.shape[0])
        with self._lock:
            found = [r for r in self._mine() if r.prefilling and r.pending.namespace in (namespace, None)
                     and (length in r.pending.wanted or length == r.pending.final)
                     and r.pending.tokens.shape[0] >= length and np.array_equal(r.pending.tokens[:length], prefix)]
            for row in found:
                if row.pending.namespace is None:
                    row.pending.named(namespace)
            return found

    # ------------------------------------------------------------------ endings

    @property
    def closed(self) -> bool:
        return self._closed

    def refuses(self, event: str) -> bool:
        """Whether this scope is closed: ``event`` (a lookup) gets no session, failing closed
        (a cold prefill; raised under ``APC_TEST_FAULTS=1``)."""
        if not self._closed:
            return False
        fail_closed(ScopeClosedError(f"{event} in a closed scope"), "apc_lineage session", log=log)
        return True

    def close(self, ending: Callable[[Session], object]) -> Optional[int]:
        """This scope's coordinator is done (its batch generator closed, or its single-sequence
        call ended: no event of its rows will come): no session is added to it any more, each
        of its sessions not over is ended by ``ending`` (the coordinator's: its loan given
        back, its deferral committed or dropped, ``LineageCoordinator.close``), a record with
        no first token is cancelled in prefill, and every session of the scope leaves the
        book, what it holds of the cache let go (``release``). Idempotent: mlx-vlm closes a
        generator again from its ``__del__``. Returns how many sessions the scope had (None:
        closed before)."""
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            rows = self._mine()
        try:
            for row in rows:
                self._close_row(row, ending)
        finally:
            with self._lock:
                for row in self._mine():
                    self._drop(row)
            self._let_go()
        return len(rows)

    def _close_row(self, row: Session, ending: Callable[[Session], object]) -> None:
        try:
            if not row.over:
                ending(row)
        except Exception as exc:  # it leaves all the same: what it holds is let go at ``release``
            fail_closed(exc, f"apc_lineage closing row {row.uid!r}", log=log)
        if row.record is not None and not row.timed and row.uid is not None:
            row.timed = True
            self.timings.cancel(row.record, row.request_id if row.request_id is not None else row.uid, PREFILL)

    def end(self, row: Session, event: str) -> None:
        """``event`` (leaving, removed, a prefill end with no uid) ended the row: ENDED, and
        forgotten once its record is finished too."""
        if row.move(SessionState.ENDED, event):
            self.waits.ended(row)
            self.tidy(row)

    def tidy(self, row: Session) -> None:
        """After a commit, a loan's end or the row's end: once no commit of it is left to come
        (past its prefill end, no deferral, no reply) its captures are let go (the entry holds
        what it kept); once nothing more can happen to it, the row is forgotten."""
        if not row.prefilling and row.deferral is None and row.reply is None:
            row.pending.taken = {}
        if row.over:
            self.forget(row)

    def forget(self, row: Session) -> None:
        with self._lock:
            self._drop(row)
        self._let_go()

    def _drop(self, row: Session) -> None:
        self._rows.pop(row.seq, None)
        if row.uid is not None and self._by_uid.get((row.scope, row.uid)) is row:
            del self._by_uid[(row.scope, row.uid)]
        if self._release is not None:
            self._forgotten.append(row)

    def _let_go(self) -> None:
        """What the rows forgotten meanwhile hold of the cache is let go, outside the book's
        lock (the cache takes its own)."""
        if self._release is None or not self._forgotten:
            return
        with self._lock:
            rows = self._forgotten[:]  # the list is every scope's: emptied in place
            self._forgotten.clear()
        for row in rows:
            self._release(row)

    def decoded(self, uids: Sequence[int], tokens: Sequence[int]) -> None:
        """One decode step: ``tokens[i]`` was fed to row ``uids[i]`` (its tracked reply grows).
        A step of another shape than this hook was written for stops the tracking of its rows."""
        self.decode_steps += 1
        tracked = [(row, i) for i, uid in enumerate(uids) if (row := self.by_uid(uid)) is not None
                   and row.reply is not None]
        for row, i in tracked:
            if len(uids) != len(tokens):
                row.reply = None
            elif row.reply is not None:  # it is: ``tracked`` holds rows with a reply
                row.reply.fed.append(int(tokens[i]))

    # ------------------------------------------------------------------ the record's events

    def _open_record(self, uid: Optional[int]) -> Optional[tuple[Session, RequestTiming]]:
        """Row ``uid`` and its record, if it has one not finished yet."""
        row = self.by_uid(uid)
        return (row, row.record) if row is not None and row.record is not None and not row.timed else None

    def prefill_completed(self, uid: Optional[int], request_id: object, prefill_s: float) -> None:
        """The server's prompt-time report: the record's restore line."""
        if (found := self._open_record(uid)) is not None:
            row, record = found
            row.request_id = request_id
            self.timings.log_restore(record, request_id, prefill_s)

    def first_token(self, uid: Optional[int], request_id: object, ttft_s: float) -> None:
        """The first token reached the client: the record is finished."""
        if (found := self._open_record(uid)) is not None:
            row, record = found
            row.request_id = request_id
            self._timed(row)
            self.timings.finish(record, request_id, ttft_s)

    def cancelled(self, uid: Optional[int], request_id: object) -> Optional[RequestTiming]:
        """Request ``uid`` was cancelled (called once the generator let it go): a record with
        no first token ends here, cancelled in prefill; one already finished is marked
        cancelled in decode where it lies in the ring (``TimingBook.cancel``)."""
        if (found := self._open_record(uid)) is not None:
            row, record = found
            self._timed(row)
            return self.timings.cancel(record, request_id, PREFILL)
        finished = self.timings.finished_record(uid)
        return self.timings.cancel(finished, request_id, DECODE) if finished is not None else None

    def _timed(self, row: Session) -> None:
        row.timed = True
        self.tidy(row)


__all__ = ["ROWS_MAX", "WAITING", "ScopeClosedError", "Session", "SessionBook", "SessionState", "SessionStateError"]
