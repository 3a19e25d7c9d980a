"""Disk restore points loaded while the request waits in the queue, not on the generation thread.

mlx-vlm serves every row from one generation thread: a disk file read at lookup (read, digest,
build, evaluate: 1.6-1.8 s for a 545 MB file) freezes every decoding stream (issue 29). So a
queued prompt is first looked ahead (``LineageCache.lookup(counted=False)``): if its best
restore point is a disk file, the read starts at once on the requests' loader thread
(``REQUEST_LOADS``, a ``disk.loader.BackgroundLoads``: the prefetch) and the prompt stays in
mlx-vlm's queue, its row LOADING (``integration.rowlife``), while the batch goes on decoding;
the prompts behind it may be admitted meanwhile. At a later step its load has finished and its
lookup restores from the entry it read (promoted into RAM, as a lookup's own load was), or the
file was rejected (forgotten, and the next disk point it would restore from loads the same
way); one still loading after ``APC_DISK_LOAD_WAIT_MS`` is admitted cold and its file kept.
Its record says how long it waited and how many decode steps the batch took meanwhile.

The lookup's disk tier is then ``RequestDisk``: the answer of the load this request waited for;
a plan that turned to another file after all (rare: its sweep committed something) loads that
one on the generation thread, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from server_patch import clock, settings
from server_patch.disk import faults
from server_patch.disk.loader import BackgroundLoads
from server_patch.integration.pending import Pending, RequestKey, request_key
from server_patch.integration.rowlife import RowBook, RowState
from server_patch.lineage import DISK
from server_patch.lineage.flow import NOT_LOADED
from server_patch.lineage.misses import Lost

IDLE_WAIT_S = 0.005  # with nothing decoding, a poll waits this long for the file (no busy loop)

# The requests' loader thread: not the canary's (``disk.loader.LOADS``), so a request's load
# never waits behind a check's, nor shares (and loses) one of the same file.
REQUEST_LOADS = BackgroundLoads()


@dataclass
class Load:
    """One queued request's disk load."""

    record: Any  # the ``DiskRecord`` its look-ahead found (the next one after a rejected file)
    length: int  # the restore point's length in it
    started: float  # ``clock.steady()`` when it started
    steps_at_start: int  # the book's decode steps then
    answer: Optional[tuple[Any, str]] = None  # ``load_checked``'s, once finished
    late: bool = False  # still loading past the bound: admitted cold
    done: bool = False  # loaded, late, or no file left to load
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (length, why) of files it rejected


def _load_checked(store: Any) -> Callable[[Any], Any]:
    def load(record: Any) -> Any:
        faults.before_load()
        return store.load_checked(record)

    return load


class DiskLoads:
    """The queued prompts of one runtime whose restore points are loading."""

    def __init__(self, runtime: Any, book: RowBook, loads: BackgroundLoads = REQUEST_LOADS) -> None:
        self.runtime = runtime
        self.book = book
        self.loads = loads

    def admissible(self, queue: list, prompt_of: Callable[[Any], tuple[np.ndarray, str]], limit: int, *,
                   idle: bool = False) -> int:
        """How many of ``queue``'s first prompts may be admitted now (at most ``limit``):
        ``queue`` is reordered in place, those still loading behind the others, each group in
        its order. ``prompt_of``: a queued item's tokens and namespace; ``idle``: nothing
        decodes, so a poll may wait a little for its file."""
        ready, waiting, queued = [], [], set()
        for item in queue:
            prompt, namespace = prompt_of(item)
            queued.add(request_key(namespace, prompt))
            if len(ready) >= limit:
                waiting.append(item)
            else:
                (ready if self.ready(prompt, namespace, idle=idle and not ready) else waiting).append(item)
        self._forget_gone(queued)
        queue[:] = ready + waiting
        return len(ready)

    def ready(self, prompt: np.ndarray, namespace: str, *, idle: bool = False) -> bool:
        """False while this prompt's disk restore point loads (the first call starts it)."""
        if prompt.shape[0] < 2 or (disk := self.runtime.disk) is None:
            return True
        row = self.book.by_key(request_key(namespace, prompt))
        if row is not None and row.state != RowState.LOADING:
            return True  # the same prompt admitted this step already: its own plan stands
        if row is None:
            plan = self._disk_plan(prompt, namespace)
            if plan is None:
                return True
            row = self.book.loading(Pending(prompt, namespace, plan),
                                    Load(plan.record, plan.length, clock.steady(), self.book.decode_steps))
        load = row.load
        if load.done:
            return True
        finished, answer = self.loads.poll(disk, load.record, load=_load_checked(disk), kept=True,
                                           wait_s=IDLE_WAIT_S if idle else 0.0)
        if finished and answer[0] is None:
            self._rejected(load, answer[1], prompt, namespace)
        elif finished:
            load.answer, load.done = answer, True
        elif (clock.steady() - load.started) * 1000 >= settings.value("APC_DISK_LOAD_WAIT_MS"):
            load.late = load.done = True
            self.loads.forget(disk, load.record)
        return load.done

    def _disk_plan(self, prompt: np.ndarray, namespace: str) -> Any:
        """The look-ahead: its plan if it restores from a disk file (and the tier is not
        refused), else None."""
        plan = self.runtime.cache.lookup(prompt, namespace, counted=False)
        return plan if plan.tier == DISK and not self.runtime.refuses(DISK) else None

    def _rejected(self, load: Load, why: str, prompt: np.ndarray, namespace: str) -> None:
        """Its file failed validation: forgotten (as a lookup's own load would), and the next
        disk file the prompt would restore from starts loading, if any."""
        self.runtime.cache.promote(load.record, None, reason=why)
        load.rejected.append((load.length, why or "failed validation"))
        plan = self._disk_plan(prompt, namespace)
        if plan is None:
            load.done = True
        else:
            load.record, load.length = plan.record, plan.length

    def _forget_gone(self, queued: set[RequestKey]) -> None:
        """LOADING rows no longer queued (cancelled while loading): ended, their loads dropped."""
        for row in self.book.rows():
            if row.state == RowState.LOADING and row.key not in queued:
                if self.runtime.disk is not None and row.load is not None:
                    self.loads.forget(self.runtime.disk, row.load.record)
                row.load = None
                self.book.end(row, "left the queue")

    def for_request(self, key: RequestKey, record: Any) -> "RequestDisk":
        """The disk tier of request ``key``'s lookup (``record``: its timing record, which gets
        the wait); the row's load is handed over, so the row holds no arrays."""
        row = self.book.by_key(key)
        load = row.load if row is not None and row.state == RowState.LOADING else None
        if load is not None and record is not None:
            record.loading_ms = (clock.steady() - load.started) * 1000
            record.loading_steps = self.book.decode_steps - load.steps_at_start
        return RequestDisk(self.runtime.disk, load, list(load.rejected) if load is not None else [])


@dataclass
class RequestDisk:
    """One lookup's disk tier (``lineage.flow.DiskLoader``): the load it waited for, else the store."""

    store: Any
    load: Optional[Load]
    rejected: list[tuple[int, str]]  # files rejected while it waited: what its admission met

    def tell(self, admission: Any) -> None:
        """The files rejected while it waited are what its admission met (``Admission.met``)."""
        for length, why in self.rejected:
            admission.met(length, Lost.DISK_REJECTED, why)

    def load_checked(self, record: Any) -> tuple[Any, str]:
        load, self.load = self.load, None  # taken once: its arrays go to the cache or nowhere
        if load is not None and load.record.id == record.id:
            if load.late:
                return None, NOT_LOADED
            if load.answer is not None:
                return load.answer
        return self.store.load_checked(record)


__all__ = ["IDLE_WAIT_S", "REQUEST_LOADS", "DiskLoads", "Load", "RequestDisk"]
