"""Where checks run: on the generation thread, between two turns of its loop, only when idle.

mlx-vlm 0.7.10 runs every forward on one thread (``ResponseGenerator._run_impl``: it owns the
``BatchGenerator``, and MLX arrays and streams must not be used for a forward from two threads
at once). The overlay adds one call to ``on_idle`` where that loop finds no active request
(``overlay/patches/canary.py``). A check runs there chunk by chunk and, between chunks, looks
at the request queue and the HTTP in-flight count: a request waiting (or being tokenized)
abandons the check at once, so a request waits for at most one chunk (``APC_CANARY_CHUNK``
tokens of forward). The job stays queued and resumes, from its first unfinished entry, once
the server has been idle for ``APC_CANARY_IDLE_S`` again.

Jobs come from ``POST /admin/verify`` (``submit``) and, with ``APC_CANARY_INTERVAL_S`` > 0,
from the schedule: one sampled restore point per interval.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from server_patch import clock, settings

from server_patch.infra.traffic import Traffic
from server_patch.canary import faults, points as P
from server_patch.canary.book import Book
from server_patch.canary.check import ERROR, SKIP, Abandoned, Result, Settings, check_entry, compute_dtype
from server_patch.canary.compare import Tolerance, tolerance_for
from server_patch.state.splits import family_of
from server_patch.lineage import DISK

log = logging.getLogger("server_patch.canary")


@dataclass(frozen=True)
class Schedule:
    interval_s: float = 0.0  # 0: no scheduled checks
    idle_s: float = 1.0  # quiet time after the last request before a check starts

    @classmethod
    def from_env(cls, environ: Any = os.environ) -> "Schedule":
        return cls(settings.value("APC_CANARY_INTERVAL_S", environ), settings.value("APC_CANARY_IDLE_S", environ))


def settings_from_env(environ: Any = os.environ) -> Settings:
    return Settings(chunk=max(1, settings.value("APC_CANARY_CHUNK", environ)),
                    max_tokens=max(2, settings.value("APC_CANARY_MAX_TOKENS", environ)))


@dataclass
class Job:
    points: list[P.Point]
    source: str  # "admin" or "schedule"
    remaining: dict[tuple[str, str], list[P.Point]] = field(default_factory=dict)
    results: list[Result] = field(default_factory=list)
    abandons: int = 0
    cancelled: bool = False
    announced: bool = False  # its start (or resumption) is logged: not again at each pass of a file load
    memo: dict[bytes, Any] = field(default_factory=dict)  # cold logits by the tokens they follow
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.remaining = P.grouped(self.points)


class Runner:
    """Runs queued checks when the server is idle; records each result in ``book``. ``traffic``:
    the HTTP side's in-flight count and last finish, which ``busy``/``quiet`` read."""

    def __init__(self, book: Book, traffic: Traffic, settings: Settings | None = None,
                 schedule: Schedule | None = None) -> None:
        self.book = book
        self.traffic = traffic
        self.settings = settings or settings_from_env()
        self.schedule = schedule or Schedule.from_env()
        self._jobs: deque[Job] = deque()
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._next_sample = time.monotonic() + self.schedule.interval_s
        self._tolerance: tuple[int, Tolerance] | None = None
        self.running = False

    def submit(self, points: list[P.Point], source: str = "admin") -> Job:
        job = Job(list(points), source)
        if not job.remaining:
            job.done.set()
            return job
        with self._lock:
            self._jobs.append(job)
        return job

    def queued(self) -> int:
        with self._lock:
            return sum(1 for j in self._jobs if not j.cancelled)

    def on_idle(self, generator: Any, runtime: Any) -> None:
        """One pass: start or resume the first job, unless anything asks for the GPU thread."""
        faults.corrupt_states(runtime)

        def busy() -> bool:
            return _busy(generator, self.traffic)

        if busy() or not _quiet_for(self.traffic, self.schedule.idle_s):
            return
        job = self._next_job(runtime)
        if job is None:
            return
        model = getattr(generator.model, "language_model", generator.model)
        tol = self._tolerance_of(model)
        self.running = True
        if not job.announced:
            job.announced = True
            log.info("apc_canary %s check of %d restore points (%d entries left), source=%s",
                     "resuming" if job.abandons else "starting", len(job.points), len(job.remaining), job.source)
        try:
            while job.remaining and not job.cancelled:  # cancelled: its caller stopped waiting
                (entry_id, tier), targets = next(iter(job.remaining.items()))
                results = self._group(runtime, model, entry_id, tier, targets, tol,
                                      lambda: faults.pause(busy) or busy(), job.memo)
                del job.remaining[(entry_id, tier)]
                for result in results:
                    job.results.append(result)
                    self.book.record(result, runtime)
        except LoadPending:
            return  # its file loads on the loader thread: the next idle pass goes on
        except Abandoned:
            job.abandons += 1
            job.announced = False  # its resumption is news
            self.book.abandoned()
            log.info("apc_canary abandoned: a request arrived; %d entries of the check left, retried when idle",
                     len(job.remaining))
            return
        finally:
            self.running = False
        with self._lock:
            if self._jobs and self._jobs[0] is job:
                self._jobs.popleft()
        mx.clear_cache()  # the reference prefill's buffers go back now, not at the next request
        job.done.set()

    def _next_job(self, runtime: Any) -> Job | None:
        with self._lock:
            while self._jobs and self._jobs[0].cancelled:
                self._jobs.popleft().done.set()
            if self._jobs:
                return self._jobs[0]
        if self.schedule.interval_s <= 0 or time.monotonic() < self._next_sample:
            return None
        self._next_sample = time.monotonic() + self.schedule.interval_s
        point = P.sample(runtime.cache, self._rng)
        return self.submit([point], source="schedule") if point is not None else None

    def _tolerance_of(self, model: Any) -> Tolerance:
        if self._tolerance is None or self._tolerance[0] != id(model):
            self._tolerance = (id(model), tolerance_for(compute_dtype(model), family=family_of(model)))
        return self._tolerance[1]

    def _group(self, runtime: Any, model: Any, entry_id: str, tier: str, targets: list[P.Point],
               tol: Tolerance, should_yield: Any, memo: dict[bytes, Any]) -> list[Result]:
        entry, why = (_from_disk(runtime, entry_id) if tier == DISK else _from_ram(runtime, entry_id))
        if entry is None:
            return [Result(p, SKIP, why) for p in targets]
        try:
            return check_entry(model, runtime.layout, entry, targets, tol, self.settings, should_yield, memo,
                               _media_ids(model), _prefix_bases(runtime.cache, entry))
        except Abandoned:
            raise
        except Exception as exc:  # a check that cannot run says why; it never breaks the loop
            log.warning("apc_canary check of %s failed to run: %s", entry_id, exc)
            return [Result(p, ERROR, f"{type(exc).__name__}: {exc}") for p in targets]


class LoadPending(Exception):
    """A disk point's file is still loading off the generation thread; the check resumes later."""


def _from_ram(runtime: Any, entry_id: str) -> tuple[Any, str]:
    entry = runtime.cache.get(entry_id)
    if entry is None:
        return None, "entry no longer in RAM (absorbed or evicted since it was chosen)"
    if entry.lent:
        return None, "entry's KV rows are lent to a running request"
    return entry, ""


def _from_disk(runtime: Any, record_id: str) -> tuple[Any, str]:
    """The file loaded into a temporary entry, through the same validation a request's load
    runs, and not promoted: a check must not change what RAM holds (promoting would evict
    conversations to make room, and an idle canary would reorder the LRU). A file that fails
    validation is forgotten exactly as a request's lookup forgets it. The file loads on the
    runtime's check loader (``LineageRuntime.checks``), never on the generation thread:
    ``LoadPending`` until done."""
    record = next((r for r in runtime.cache.records() if r.id == record_id), None)
    if record is None or runtime.disk is None:
        return None, "file no longer on disk"
    ready, loaded = runtime.checks.poll(runtime.disk, record)
    if not ready:
        raise LoadPending(record_id)
    entry, why = loaded
    if entry is None:
        why = why or "failed validation"
        runtime.cache.promote(record, None, reason=why)
        return None, f"file rejected by the disk tier ({why}): requests prefill it cold"
    return entry, ""


def _prefix_bases(cache: Any, entry: Any) -> dict[int, tuple[Any, Any]]:
    """Restore points of other RAM entries (anchors, shorter lineages) whose tokens ``entry``'s
    start with: more places a window check may start from. Lent rows are left out."""
    from server_patch.lineage.lookup import common_prefix_len

    bases: dict[int, tuple[Any, Any]] = {}
    for other in cache.entries():
        if other.id == entry.id or other.lent or other.namespace != entry.namespace \
                or other.length >= entry.length or common_prefix_len(entry.tokens, other.tokens) < other.length:
            continue
        for length, _, cp in other.restore_points():
            bases.setdefault(length, (other.kv, cp.state if cp is not None else other.head))
    return bases


def _media_ids(model: Any) -> frozenset[int]:
    """The model's image/audio/video placeholder ids, as mlx-vlm's batch generator finds them."""
    config = getattr(model, "config", None)
    if config is None:
        return frozenset()
    try:
        from mlx_vlm.apc import multimodal_token_ids_from_config

        return frozenset(int(t) for t in multimodal_token_ids_from_config(config))
    except Exception:
        return frozenset()


def _busy(generator: Any, traffic: Traffic) -> bool:
    """A request is queued for the generation thread, or in flight on the HTTP side (being
    read or tokenized, not queued yet), or the server is stopping."""
    try:
        queued = not generator.requests.empty()
    except AttributeError:
        queued = False
    return queued or traffic.in_flight > 0 or bool(getattr(generator, "_stop", False))


def _quiet_for(traffic: Traffic, seconds: float) -> bool:
    last = traffic.last_finished
    return last is None or clock.monotonic() - last >= seconds
