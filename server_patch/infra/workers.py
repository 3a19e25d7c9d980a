"""A runtime's background workers, run on threads the process keeps and reuses on purpose.

Each lineage runtime (one per loaded model) owns its workers (``Workers``: the disk writer, the
idle ticker, the requests' disk loader and the stager of queued restores' copies): it builds them, and its ``close`` closes them, so two runtimes in one
process never share a queue, and a replaced runtime leaves no worker of its own behind.

**Why the threads are reused, deliberately.** MLX (0.32) gives every thread that runs MLX work
a native stream thread of its own and never frees it. A worker thread started per runtime and
ended at its close would leave one native thread behind at every model switch. So a worker
does not own its OS thread: it borrows one from the process's ``ThreadPark`` when it starts and
hands it back when it closes, and the next runtime's worker runs on the same thread (and the
stream its setup made there, once per thread). The park is the one process-level object of
this module, on purpose: it holds idle threads and nothing of any runtime (no queue, no job, no
setting survives a worker's close); ``PARK`` is it. A parked thread is named ``apc-parked``; a
lent one carries its worker's name (what ``/admin/model`` lists).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from typing import Any, Callable, TypeVar

log = logging.getLogger("server_patch.infra")

Job = Callable[[], None]
PARKED = "apc-parked"
T = TypeVar("T")


class _ParkedThread:
    """One OS thread of the park: runs the loops it is lent, one after another, forever."""

    def __init__(self, park: ThreadPark) -> None:
        self._park = park
        self._work: queue.SimpleQueue[tuple[str, Job, Job | None, Job | None]] = queue.SimpleQueue()
        self._setups_done: set[Job] = set()  # a setup (an MLX stream) runs once per thread
        self.thread = threading.Thread(target=self._serve, name=PARKED, daemon=True)

    def lend(self, name: str, run: Job, setup: Job | None, returned: Job | None) -> None:
        self.thread.name = name  # named when lent, not when it wakes: what /admin/model lists
        self._work.put((name, run, setup, returned))

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            name, run, setup, returned = self._work.get()
            try:
                if setup is not None and setup not in self._setups_done:
                    setup()
                    self._setups_done.add(setup)
                run()
            except Exception as exc:  # a worker's loop must not take the park's thread with it
                log.warning("worker %s ended with %s: %s", name, type(exc).__name__, exc)
            finally:
                me.name = PARKED
                self._park.give_back(self)
                if returned is not None:
                    returned()  # after the thread is idle again: the next lend may take it


class ThreadPark:
    """Threads lent to workers and taken back when they close; started only when none is idle."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_ParkedThread] = []
        self._started = 0

    def lend(self, name: str, run: Job, setup: Job | None = None, returned: Job | None = None) -> None:
        """Run ``run`` (after ``setup``, if this thread never ran it) on an idle thread, else a new one;
        the thread comes back when ``run`` returns, and then ``returned`` is called."""
        with self._lock:
            parked = self._idle.pop() if self._idle else None
            if parked is None:
                parked = _ParkedThread(self)
                self._started += 1
                parked.thread.start()
        parked.lend(name, run, setup, returned)

    def give_back(self, parked: _ParkedThread) -> None:
        with self._lock:
            self._idle.append(parked)

    def counts(self) -> dict[str, int]:
        """Threads this park started, and how many of them are idle now."""
        with self._lock:
            return {"threads": self._started, "parked": len(self._idle)}


PARK = ThreadPark()  # the process's threads that may have run MLX work: kept, reused (see above)


class Worker:
    """Jobs run in order on one borrowed thread, from the first ``submit`` (or ``start``) to ``close``."""

    def __init__(self, name: str, park: ThreadPark | None = None, *, setup: Job | None = None,
                 capacity: int = 0) -> None:
        self.name = name
        self._park = PARK if park is None else park
        self._setup = setup
        self._capacity = capacity  # queued jobs beyond which ``submit`` refuses (0: no limit)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._started = self._closed = False
        self._ended = threading.Event()

    def start(self) -> Worker:
        """Borrow the thread now (otherwise at the first job); idempotent."""
        with self._lock:
            self._start_locked()
        return self

    def _start_locked(self) -> None:
        if not self._started and not self._closed:
            self._started = True
            self._park.lend(self.name, self._run, self._setup, self._ended.set)

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (never a wait) when the queue is full or the worker is closed."""
        with self._lock:  # so no job lands behind the closing marker
            if self._closed:
                return False
            if self._capacity and self._jobs.qsize() >= self._capacity:
                return False
            self._start_locked()
            self._jobs.put(job)
        return True

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """``fn(*args)`` queued as a job, its answer (or exception) in the future returned; a
        worker that refuses it (closed, full) answers a future failed at once: its caller's
        poll fails closed (``disk.loader.BackgroundLoads`` runs its loads this way)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # the caller's poll reads it
                    future.set_exception(exc)

        if not self.submit(job):
            future.set_exception(RuntimeError(f"{self.name} is closed or full"))
        return future

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job queued so far has run; False on timeout."""
        if not self._started:
            return True
        done = threading.Event()
        if not self.submit(done.set):
            return False
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Run what is queued, then give the thread back; later jobs are refused. Returns whether
        the thread is back within ``timeout`` (a job still running keeps it until it returns)."""
        with self._lock:
            if self._closed:
                return self._ended.is_set() or not self._started
            self._closed = True
            started = self._started
        if not started:
            return True
        self._jobs.put(None)  # after every queued job
        return self._ended.wait(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except Exception as exc:  # one failed job must not end the worker
                log.warning("%s: a job failed: %s: %s", self.name, type(exc).__name__, exc)
            finally:
                self._jobs.task_done()


class Workers:
    """One runtime's workers: built through it, closed with it (the last built first)."""

    def __init__(self, park: ThreadPark | None = None) -> None:
        self.park = PARK if park is None else park
        self._workers: list[Worker] = []

    def worker(self, name: str, *, setup: Job | None = None, capacity: int = 0) -> Worker:
        made = Worker(name, self.park, setup=setup, capacity=capacity)
        self._workers.append(made)
        return made

    def names(self) -> list[str]:
        return [w.name for w in self._workers if not w.closed]

    def close(self, timeout: float | None = None) -> bool:
        """Close every worker (each for at most ``timeout`` seconds); whether all threads are back."""
        return all([w.close(timeout) for w in reversed(self._workers)])
