"""Disk files loaded off the generation thread (issue 29).

mlx-vlm serves every row from one generation thread, so a file read there (read, digest,
build, evaluate: 0.6-1.8 s for a 545 MB file) freezes every decoding stream and delays every
arriving request. ``BackgroundLoads`` runs ``DiskStore.load_checked`` on one thread of its own
(MLX gives each thread that runs MLX work a native stream it never frees, so one thread, not
one per load) and answers ``poll`` without blocking: not ready yet, or what ``load_checked``
answers (the validated entry, or None and why the file was rejected). The loaded arrays are evaluated on
the loader's stream before the entry is handed over, so the generation thread may use them.
Any other job with the same shape (a callable answering ``(result or None, reason)``) may run
on one of its own: the staged copies of queued RAM restores do (``integration.staging``).
Each lives on a runtime, on one of its workers (``LineageRuntime.loads``, ``.stages`` and the
canary's ``.checks``): none is the process's, so two runtimes never share a queue of loads.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any, Callable, Optional

import mlx.core as mx

THREAD_NAME = "apc-disk-load"
CHECKS_THREAD = "apc-canary-load"  # a runtime's loader of the canary's checks (``LineageRuntime.checks``)
log = logging.getLogger("server_patch.disk")


def _own_stream() -> None:
    mx.set_default_stream(mx.new_stream(mx.cpu))  # MLX streams are per thread: its own


class BackgroundLoads:
    """Loads by (store, record id) on one loader thread; ``poll`` never waits for a file."""

    def __init__(self, thread_name: str = THREAD_NAME, *,
                 submit: Optional[Callable[..., concurrent.futures.Future]] = None) -> None:
        """``submit``: where the loads run (a runtime's ``infra.workers.Worker.call``, on a thread
        the process reuses); default: a thread of this object's own, named ``thread_name``."""
        if submit is None:
            submit = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name,
                                                           initializer=_own_stream).submit
        self._submit = submit
        self._pending: dict[tuple[int, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._kept: set[tuple[int, str]] = set()

    def poll(self, store: Any, record: Any, *, load: Optional[Callable[[Any], Any]] = None,
             wait_s: float = 0.0, kept: bool = False) -> tuple[bool, Any]:
        """(False, None) while ``record``'s file loads (the first call starts it); then, once,
        (True, ``load_checked``'s (entry or None, reason)). Finished loads nobody asked for again (a check
        cancelled meanwhile) are dropped here, so they hold no arrays. ``load``: what runs on
        the loader thread instead of ``store.load_checked`` (the same answer; a fault hook
        around it); ``wait_s``: how long to wait for it (a caller with nothing else to do);
        ``kept``: its owner polls again until it takes the answer or ``forget``s it (a queued
        request's load, ``integration.loading``), so others' polls never drop it as stale."""
        key = (id(store), record.id)
        with self._lock:
            if kept:
                self._kept.add(key)
            for stale in [k for k, f in self._pending.items() if k != key and f.done() and k not in self._kept]:
                del self._pending[stale]
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = self._submit(load or store.load_checked, record)
                if wait_s <= 0:
                    return False, None
        if wait_s > 0:
            concurrent.futures.wait([future], timeout=wait_s)
        with self._lock:
            if not future.done() or self._pending.get(key) is not future:
                return False, None
            del self._pending[key]
            self._kept.discard(key)
        try:
            return True, future.result()
        except Exception as exc:  # ``load`` rejects what it cannot read; anything else fails closed too
            log.warning("lineage disk: background load of %s failed: %s", record.id, exc)
            return True, (None, f"load failed: {exc}")

    def run(self, job: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """``job(*args)`` on the loader's thread, in turn with its loads, answered to nobody: a
        job whose result its owner keeps itself (``JointSpares.make``: the joint buffers made
        ahead); a failure is logged, as the worker logs a failed job."""
        future = self._submit(job, *args)
        future.add_done_callback(_log_failure)
        return future

    def forget(self, store: Any, record: Any) -> None:
        """Nobody will ask for ``record``'s load again (its request left the queue): dropped
        once it finishes, as a stale one."""
        with self._lock:
            self._kept.discard((id(store), record.id))

    def pending(self) -> int:
        with self._lock:
            return sum(1 for f in self._pending.values() if not f.done())


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.warning("lineage disk: a background job failed: %s: %s", type(exc).__name__, exc)


__all__ = ["CHECKS_THREAD", "THREAD_NAME", "BackgroundLoads"]
