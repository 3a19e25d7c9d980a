"""Disk restore points loaded while the request waits in the queue, not on the generation thread.

mlx-vlm serves every row from one generation thread: a disk file read at lookup (read, digest,
build, evaluate: 1.6-1.8 s for a 545 MB file) freezes every decoding stream (issue 29). So a
queued prompt is first looked ahead (``LineageCache.lookup(counted=False)``): if its best
restore point is a disk file, the read starts at once on the runtime's loader (``LineageRuntime.loads``, a
``disk.loader.BackgroundLoads`` on a worker of the runtime's: the prefetch) and the prompt stays in
mlx-vlm's queue, its row LOADING (``integration.session``), while the batch goes on decoding;
the prompts behind it may be admitted meanwhile. At a later step its load has finished and its
lookup restores from the entry it read (promoted into RAM, as a lookup's own load was), or the
file was rejected (forgotten, and the next disk point it would restore from loads the same
way); one still loading after ``APC_DISK_LOAD_WAIT_MS`` is admitted cold and its file kept.
Its record says how long it waited and how many decode steps the batch took meanwhile.

The same queue holds prompts whose RAM restore would take the merge copy: they wait in
STAGING while the copy is made on the stager thread (``integration.staging``), and a prompt
with a staged buffer is admitted alone in its prompt batch, so no merge copies it again. A file
loaded while others decode is promoted at once, and its entry's merge copy staged the same way
(LOADING -> STAGING): a loaded file's buffers have no room to be lent.

Holds (issue 34 item 5): before its file's read starts, the request holds the entry
(``LineageCache.hold``, ``lineage.holds``): the file's bytes are counted in the RAM budget while it
loads, and once promoted the entry cannot be evicted by another load, commit or promotion until
the lookup admits the request (``release``), or it leaves the queue. A load the budget cannot
hold beside those already held waits its turn in LOADING (the first always starts, so every
request whose entry alone fits the budget restores); its wait bound counts from its start.

Prefetch: mlx-vlm reaches ``admissible`` only when it would admit (room in the batch, no
multi-chunk prefill running), so every step it also calls ``prefetch``: the first queued
prompts are looked ahead once each (memoised by uid) and their loads and staged copies start
while the batch is full or a prefill runs; those waiting are polled. O(queued) dictionary work
per step, one look-ahead per queued prompt.

The lookup's disk tier is then ``RequestDisk``: the answer of the load this request waited for.
A plan that turns to another file only at the lookup itself (rare: its sweep committed
something, or a write landed between the look-ahead and the lookup) is never loaded on the
generation thread: the file this request did load is promoted, and the lookup plans again from
RAM alone (``flow.NOT_AHEAD``, counted as ``disk_unused``). Deferring the admission again would
lose no tokens, but mlx-vlm has already taken the prompt out of its queue at the lookup; the
RAM plan loses only the tokens between the file's point and the best point in RAM, and blocks
no stream. The single-sequence path (no batch generator attached) has no queue and no other
stream on its thread: its lookup loads there, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from server_patch import clock, settings
from server_patch.disk import faults
from server_patch.disk.loader import BackgroundLoads
from server_patch.integration import staging, waits
from server_patch.integration.pending import Pending, RequestKey, request_key
from server_patch.integration.session import WAITING, SessionBook, Session, SessionState
from server_patch.integration.staging import Stagings
from server_patch.lineage import DISK
from server_patch.lineage.holds import LOAD, RESERVED
from server_patch.lineage.flow import NOT_AHEAD, NOT_LOADED
from server_patch.lineage.misses import Lost
from server_patch.lineage.model import DiskRecord, Entry, RestorePlan

if TYPE_CHECKING:
    from server_patch.disk.store import DiskStore
    from server_patch.integration.batch_rows import BatchRows
    from server_patch.integration.runtime import LineageRuntime
    from server_patch.integration.timings import RequestTiming
    from server_patch.lineage.flow import Admission
    from server_patch.lineage.policy import LineageCache

# ``load_checked``'s answer: the entry read from the file (None: rejected) and why.
Answer = tuple[Optional[Entry], str]

IDLE_WAIT_S = 0.005  # with nothing decoding, a poll waits this long for the file (no busy loop)
PREFETCH_MAX = 2  # queued prompts a step looks ahead of admission: each load holds a whole entry
PREFETCHED = "prefetched"  # the stats key: loads and staged copies started while nothing was admitted

@dataclass
class Load:
    """One queued request's disk load."""

    record: DiskRecord  # the file its look-ahead found (the next one after a rejected file)
    length: int  # the restore point's length in it
    started: float  # ``clock.steady()`` when it began to wait (its record's ``loading_ms``)
    steps_at_start: int  # the book's decode steps then
    answer: Optional[Answer] = None  # ``load_checked``'s, once finished
    late: bool = False  # still loading past the bound: admitted cold
    done: bool = False  # loaded, late, or no file left to load
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (length, why) of files it rejected
    promoted: Optional[str] = None  # the entry its file became, promoted while it queued (to stage its copy)
    begun: Optional[float] = None  # ``clock.steady()`` when its read started: its turn came (``_turn``)


def _load_checked(store: DiskStore) -> Callable[[DiskRecord], Answer]:
    def load(record: DiskRecord) -> Answer:
        faults.before_load()
        return store.load_checked(record)

    return load


def _load_of(row: Session) -> Load:
    """A LOADING row's load: set with the row (``SessionBook.loading``) until its lookup."""
    assert row.load is not None, "a loading row has its load"
    return row.load


def _stage_of(row: Session) -> staging.Stage:
    """A STAGING row's staged copy: set with the row (``SessionBook.staging``, or a load
    that staged its copy) until its lookup."""
    assert row.stage is not None, "a staging row has its stage"
    return row.stage


def _begun(load: Load) -> float:
    """When ``load``'s read started: its turn came (``DiskLoads._turn`` said so first)."""
    assert load.begun is not None, "a load is polled only once its turn came"
    return load.begun


class DiskLoads:
    """The queued prompts of one runtime whose restore points are loading, or staging (where
    ``rows``, the runtime's ``BatchRows``, is given: it says which plans the merge would copy).
    Its loads run on ``loads`` (default: the runtime's loader, ``LineageRuntime.loads``: not the
    canary's, ``disk.loader.LOADS``, so a request's load never waits behind a check's, nor shares
    and loses one of the same file). The look-ahead memos below are by uid, this runtime's."""

    def __init__(self, runtime: LineageRuntime, book: SessionBook, loads: Optional[BackgroundLoads] = None, *,
                 rows: Optional[BatchRows] = None, stagings: Optional[Stagings] = None) -> None:
        self.runtime = runtime
        self.book = book
        self.loads: BackgroundLoads = runtime.loads if loads is None else loads
        self.rows = rows
        self.stagings = stagings if stagings is not None or rows is None else Stagings(runtime)
        self._ahead: dict[int, tuple[RequestKey, np.ndarray, str]] = {}  # queued uid -> looked ahead
        # queued uid -> (its token list, then its key, tokens and namespace): see ``_prompt``
        self._prompts: dict[int, tuple[object, tuple[RequestKey, np.ndarray, str]]] = {}

    def _stager(self) -> Stagings:
        """The stagings: a row stages only where they were given (``_look_ahead``,
        ``_stage_loaded``)."""
        assert self.stagings is not None, "a row stages only where stagings were given"
        return self.stagings

    def _rows(self) -> BatchRows:
        """The batch rows: only a loader with stagings stages (it is given both, or neither)."""
        assert self.rows is not None, "a row stages only where the batch rows were given"
        return self.rows

    # A queued item is mlx-vlm's queue entry (uid first, then its token list): untyped upstream.
    def _prompt(self, item: Any,
                prompt_of: Callable[[Any], tuple[np.ndarray, str]]) -> tuple[RequestKey, np.ndarray, str]:
        """A queued item's key, tokens and namespace, once per queued sequence (its uid and its
        very token list): mlx-vlm queues token lists, which would otherwise be converted and
        hashed again at every step."""
        found = self._prompts.get(item[0])
        if found is None or found[0] is not item[1]:
            prompt, namespace = prompt_of(item)
            found = self._prompts[item[0]] = (item[1], (request_key(namespace, prompt), prompt, namespace))
        return found[1]

    def admissible(self, queue: list[Any], prompt_of: Callable[[Any], tuple[np.ndarray, str]], limit: int, *,
                   idle: bool = False) -> int:
        """How many of ``queue``'s first prompts may be admitted now (at most ``limit``):
        ``queue`` is reordered in place, those still loading behind the others, each group in
        its order; a prompt with a staged buffer is admitted alone (first, or at the next step).
        ``prompt_of``: a queued item's tokens and namespace; ``idle``: nothing decodes, so a
        poll may wait a little for its file and no copy is staged (nobody would wait for it)."""
        ready: list[Any] = []
        waiting: list[Any] = []
        queued: set[int] = set()
        uids: list[int] = []
        for item in queue:
            _, prompt, namespace = self._prompt(item, prompt_of)
            queued.add(item[0])
            if len(ready) >= limit:
                waiting.append(item)
            elif self.ready(prompt, namespace, idle=idle and not ready, busy=not idle, uid=item[0]):
                ready.append(item)
                uids.append(item[0])
            else:
                waiting.append(item)
        self._prompts = {item[0]: self._prompts[item[0]] for item in queue}  # the queue's only
        self._forget_gone(queued)
        queue[:] = ready + waiting
        return self._alone(uids)

    def _alone(self, uids: list[int]) -> int:
        """How many of the ready prompts (``uids``, in order) to admit: up to the first with a
        staged buffer, which is admitted alone (a shared prompt batch would merge-copy it)."""
        for i, uid in enumerate(uids):
            row = self.book.by_uid(uid)
            if row is not None and row.state == SessionState.STAGING and row.stage is not None \
                    and row.stage.staged is not None:
                return max(i, 1)
        return len(uids)

    def prefetch(self, queue: list[Any], prompt_of: Callable[[Any], tuple[np.ndarray, str]], limit: int, *,
                 busy: bool = True, blocked: bool = True) -> None:
        """Every step, admitting or not: the first ``limit`` (at most ``PREFETCH_MAX``) queued
        prompts are looked ahead once each, so their loads and staged copies start while the
        batch is full or a prefill runs; those waiting are polled. ``busy``: rows decode or a
        prompt batch prefills (with neither, nothing is staged: the merge would stall nobody);
        ``blocked``: nothing is admitted this step, so what starts here is counted
        (``prefetched``: started ahead of the admission it would otherwise have waited for)."""
        uids = {item[0] for item in queue}
        for uid in [uid for uid in self._prompts if uid not in uids]:
            del self._prompts[uid]
        for uid in [uid for uid in self._ahead if uid not in uids]:
            del self._ahead[uid]
            self._left(uid)
        for item in queue[:min(limit, PREFETCH_MAX)]:
            uid = item[0]
            if uid not in self._ahead:
                _, prompt, namespace = self._ahead[uid] = self._prompt(item, prompt_of)
                started = self.book.by_uid(uid) is None
                self.ready(prompt, namespace, busy=busy, uid=uid)
                if blocked and started and (row := self.book.by_uid(uid)) is not None and row.state in WAITING:
                    self.runtime.cache.count(PREFETCHED)
        for uid, (_, prompt, namespace) in list(self._ahead.items()):
            row = self.book.by_uid(uid)
            if row is not None and row.state in WAITING:
                self.ready(prompt, namespace, busy=busy, uid=uid)

    def _left(self, uid: int) -> None:
        """Looked-ahead prompt ``uid`` left the queue (admitted, or cancelled): its row, if
        still waiting, ends there."""
        row = self.book.by_uid(uid)
        if row is not None and row.state in WAITING:
            self.end_waiting(row)

    def ready(self, prompt: np.ndarray, namespace: str, *, idle: bool = False, busy: bool = True,
              uid: Optional[int] = None) -> bool:
        """False while queued prompt ``uid``'s disk restore point loads or its copy stages (the
        first call starts it). ``busy``: other rows decode (a copy may be staged: see
        ``admissible``). Identical prompts queued under two uids wait each on its own."""
        if prompt.shape[0] < 2:
            return True
        row = self.book.queued(uid, request_key(namespace, prompt) if uid is None else None)
        if row is not None and row.state not in WAITING:
            return True  # admitted this step already: its own plan stands
        if row is None:
            if self.runtime.disk is None and (self.stagings is None or not busy):
                return True  # nothing it could wait for: no look-ahead
            row = self._look_ahead(prompt, namespace, busy, uid)
            if row is None:
                return True
        if row.state == SessionState.STAGING:
            return self._stager().poll(_stage_of(row), IDLE_WAIT_S if idle else 0.0)
        disk = self.runtime.disk
        assert disk is not None  # a row loads only where the runtime has a disk tier (``_look_ahead``)
        load = _load_of(row)
        if load.done:
            return True
        if (twin := self.runtime.cache.get(load.record.id)) is not None and twin.length >= load.length:
            # an identical prompt's load promoted this very file already
            self.loads.forget(disk, load.record)
            load.done = True  # its lookup restores from RAM; no second read of the same file
            return True
        if self._loaded_for_another(row):
            return False  # an identical prompt's row has read this file: its lookup promotes it
        if not self._turn(row):
            return False  # the RAM budget holds others' loads: it waits its turn
        finished, answer = self.loads.poll(disk, load.record, load=_load_checked(disk), kept=True,
                                           wait_s=IDLE_WAIT_S if idle else 0.0)
        if finished and answer[0] is None:
            self._rejected(row, answer[1], prompt, namespace)
        elif finished:
            load.answer, load.done = answer, True
            if busy and self._stage_loaded(row, prompt, namespace):
                return False
        elif (clock.steady() - _begun(load)) * 1000 >= settings.value("APC_DISK_LOAD_WAIT_MS"):
            load.late = load.done = True
            self.loads.forget(disk, load.record)
            self.release(row)
        return load.done

    def _loaded_for_another(self, row: Session) -> bool:
        """Another waiting row (an identical prompt) holds this row's file read and not yet
        promoted: this one waits for that promotion instead of reading the file again."""
        record_id = _load_of(row).record.id
        return any(other is not row and other.load is not None and other.load.answer is not None
                   and other.load.record.id == record_id for other in self.book.rows())

    def _turn(self, row: Session) -> bool:
        """Whether row's file may load now: its request holds the entry (``LineageCache.hold``)
        from before the read until its lookup admits it, so the file's bytes are counted in the
        RAM budget while it loads and, once promoted, no other load or commit evicts it. A load
        the budget cannot hold beside the others' waits (its bound counts from its start)."""
        load = _load_of(row)
        if load.begun is None:
            if not self.runtime.cache.hold(row, load.record.id, load.record.nbytes):
                return False
            load.begun = clock.steady()
        return True

    def release(self, row: Optional[Session]) -> None:
        """What ``row``'s request holds of the cache for its wait in the queue (its load, its
        staged copy's bytes) is let go: it was admitted (its lookup restored, or not), left the
        queue, or its load was abandoned. A loan it was lent at its lookup stays its own."""
        if row is not None:
            self.runtime.cache.release(row, (LOAD, RESERVED))

    def _stage_loaded(self, row: Session, prompt: np.ndarray, namespace: str) -> bool:
        """Its file loaded while others decode: the entry is promoted into RAM now, and if the
        restore would take the merge copy (the file's buffers have no room to be lent), that
        copy is staged too, the row going on waiting (LOADING -> STAGING), so neither the load
        nor the copy runs on the generation thread. False: admitted as before (the lookup
        promotes what was loaded)."""
        load = _load_of(row)
        if self.stagings is None or self.rows is None or not 0 < staging.min_tokens() <= load.length:
            return False  # too short to stage: the lookup promotes it, as before
        answer = load.answer
        assert answer is not None  # ``ready`` calls this once its poll answered
        entry = self.runtime.cache.promote(load.record, answer[0], reason=answer[1])
        load.answer = None  # in the cache now, or gone: the lookup plans from what the cache holds
        if entry is None:
            return False
        load.promoted = entry.id
        plan = self.runtime.cache.lookup(prompt, namespace, counted=False)
        stage = self._stage(plan, load.steps_at_start) if plan.entry is entry else None
        if stage is None or not row.move(SessionState.STAGING, "file loaded, copy staged"):
            if stage is not None:
                self._stager().drop(stage)
            return False
        stage.started, row.stage = load.started, stage  # its wait counts from the load's start
        self._staged(row)
        return True

    def _look_ahead(self, prompt: np.ndarray, namespace: str, busy: bool, uid: Optional[int]) -> Optional[Session]:
        """The look-ahead (no lookup): a LOADING row if the prompt restores from a disk file, a
        STAGING row if its RAM restore would take the merge copy while others decode, else None."""
        plan = self.runtime.cache.lookup(prompt, namespace, counted=False)
        pending = Pending(prompt, namespace, plan)
        if plan.tier == DISK:
            if self.runtime.disk is None or self.runtime.refuses(DISK):
                return None
            assert plan.record is not None  # a disk plan names its file
            load = Load(plan.record, plan.length, clock.steady(), self.book.decode_steps)
            return self.book.loading(pending, load, uid)
        stage = self._stage(plan, self.book.decode_steps) if busy and self.stagings is not None else None
        return self._staged(self.book.staging(pending, stage, uid)) if stage is not None else None

    def _staged(self, row: Session) -> Session:
        """Row's staged copy is counted in the RAM budget until its lookup takes it (or it
        leaves the queue): its request holds the copy's bytes (``LineageCache.reserve``), and
        the entry's rows while the stager reads them (the copy's receipt, a ``LENT`` hold that
        ends with the copy, ``staging.Stagings``)."""
        stage = _stage_of(row)
        entry = stage.entry
        nbytes = entry.kv.nbytes * stage.capacity // max(1, entry.length)  # the rows it copies, with room
        self.runtime.cache.reserve(row, f"staged:{entry.id}", nbytes)
        if stage.receipt is not None:
            self.runtime.cache.own(stage.receipt, row)
        return row

    def _stage(self, plan: RestorePlan, steps: int) -> Optional[staging.Stage]:
        """``plan``'s merge copy started on the stager thread if the merge would make it
        (``BatchRows.stageable``); None otherwise, or where the entry is refused a receipt.
        ``steps``: the book's decode steps when the wait began."""
        if not self._rows().stageable(plan, staging.min_tokens()):
            return None
        return self._stager().start(plan, self._rows().staged_capacity(plan.prompt_len), steps)

    def _disk_plan(self, prompt: np.ndarray, namespace: str) -> Optional[RestorePlan]:
        """Its plan if it restores from a disk file (and the tier is not refused), else None."""
        plan = self.runtime.cache.lookup(prompt, namespace, counted=False)
        return plan if plan.tier == DISK and not self.runtime.refuses(DISK) else None

    def _rejected(self, row: Session, why: str, prompt: np.ndarray, namespace: str) -> None:
        """Its file failed validation: forgotten (as a lookup's own load would), and the next
        disk file the prompt would restore from starts loading, if any."""
        load = _load_of(row)
        self.runtime.cache.promote(load.record, None, reason=why)
        load.rejected.append((load.length, why or "failed validation"))
        self.release(row)
        load.begun = None  # the next file waits its turn as the first did
        plan = self._disk_plan(prompt, namespace)
        if plan is None:
            load.done = True
        else:
            assert plan.record is not None  # a disk plan names its file
            load.record, load.length = plan.record, plan.length

    def _forget_gone(self, queued: set[int]) -> None:
        """Waiting rows whose uid is no longer queued (cancelled meanwhile): ended, their work
        dropped."""
        for row in self.book.rows():
            if row.state in WAITING and row.uid not in queued:
                self.end_waiting(row)

    def end_waiting(self, row: Session) -> None:
        """Waiting row ``row`` left the queue unadmitted (cancelled, or its generator closed):
        its load and staged copy dropped, what they held let go, and it has ended."""
        if self.runtime.disk is not None and row.load is not None:
            self.loads.forget(self.runtime.disk, row.load.record)
        if row.stage is not None:
            self._stager().drop(row.stage)
        row.load = row.stage = None
        self.release(row)
        self.book.end(row, "left the queue")

    def for_request(self, row: Optional[Session], record: Optional[RequestTiming]) -> Optional["RequestDisk"]:
        """The disk tier of a request's lookup (None without one; ``row``: the request's row,
        if it has one yet; ``record``: its timing record, which gets the wait in the queue);
        the row's load is handed over, so the row holds no arrays. A staged copy not finished
        by now is dropped (its receipt ends)."""
        waited = row if row is not None and row.state in WAITING else None
        work = (waited.load or waited.stage) if waited is not None else None
        if work is not None and record is not None:
            record.loading_ms = (clock.steady() - work.started) * 1000
            record.loading_steps = self.book.decode_steps - work.steps_at_start
        if waited is not None and waited.stage is not None and not waited.stage.done:
            self._stager().drop(waited.stage)
        if self.runtime.disk is None:
            return None
        load = waited.load if waited is not None else None
        inline = self.rows is not None and self.rows.generator.generator is None
        disk = RequestDisk(self.runtime.disk, load, list(load.rejected) if load is not None else [],
                           cache=self.runtime.cache, inline=inline)
        if load is not None and load.promoted is not None:
            disk.promoted.append(load.promoted)  # its file, loaded while it queued: a disk restore
        return disk


@dataclass
class RequestDisk:
    """One lookup's disk tier (``lineage.flow.DiskLoader``): the load it waited for. Another
    file is never loaded here (``NOT_AHEAD``), but on the single-sequence path (``inline``)."""

    store: DiskStore
    load: Optional[Load]
    rejected: list[tuple[int, str]]  # files rejected while it waited: what its admission met
    cache: Optional[LineageCache] = None  # where a load it waited for, of another file than planned, is promoted
    inline: bool = False  # no batch on this thread: a file may load here, as before
    promoted: list[str] = field(default_factory=list)  # ids of entries promoted here

    def tell(self, admission: Admission) -> None:
        """The files rejected while it waited are what its admission met (``Admission.met``);
        an entry it loaded and promoted here is one the admission loaded."""
        for length, why in self.rejected:
            admission.met(length, Lost.DISK_REJECTED, why)
        admission.promoted.update(self.promoted)

    def load_checked(self, record: DiskRecord) -> Answer:
        load, self.load = self.load, None  # taken once: its arrays go to the cache or nowhere
        if load is not None and load.record.id == record.id:
            if load.late:
                return None, NOT_LOADED
            if load.answer is not None:
                return load.answer
        if self.inline:  # the single-sequence path: no other stream on this thread
            return waits.run(waits.Work.LOAD, self.store.load_checked, record)
        answer = load.answer if load is not None else None
        if load is not None and answer is not None and answer[0] is not None and self.cache is not None and \
                self.cache.promote(load.record, answer[0], reason=answer[1]) is not None:
            self.promoted.append(load.record.id)  # loaded for this request: a RAM point now
        return None, NOT_AHEAD


__all__ = ["IDLE_WAIT_S", "PREFETCHED", "PREFETCH_MAX", "DiskLoads", "Load", "RequestDisk"]
