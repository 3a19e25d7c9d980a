"""One lineage runtime per loaded model: the policy, its layout, disk tier, timings, events.

Created lazily by the coordinator the first time a model is served, and registered in
``RUNTIMES`` so the admin endpoint can find it. Nothing here runs per token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from server_patch.disk.paths import default_disk_root, disk_enabled
from server_patch.disk.store import DiskStore
from server_patch.integration import journal
from server_patch.integration.timings import TimingBook
from server_patch.lineage import Event, LineageCache, LineageConfig
from server_patch.state.fingerprint import model_fingerprint
from server_patch.state.layout import CacheLayout

log = logging.getLogger("server_patch.lineage")

EVENT_RING = 4096


class LineageRuntime:
    """Everything the lineage cache needs for one model, and what /admin reads."""

    def __init__(self, language_model: Any, config: LineageConfig | None = None) -> None:
        self.config = config or LineageConfig.from_env()
        self.layout = CacheLayout.from_model(language_model)
        self.fingerprint = model_fingerprint(language_model)
        self.started = time.time()
        self.events: deque[tuple[int, float, Event]] = deque(maxlen=EVENT_RING)
        self._event_seq = 0
        self._event_lock = threading.Lock()
        self.event_listeners: list[Callable[[int, float, Event], None]] = []
        self.timings = TimingBook()
        self.disk: DiskStore | None = None
        if disk_enabled():
            root = default_disk_root() / self.fingerprint[:16]
            self.disk = DiskStore(root, fingerprint=self.fingerprint, layout=self.layout)
        self.cache = LineageCache(self.config, disk=self.disk, on_event=self._record_event)
        # Request records and cache events also go to the on-disk journal (apcctl report).
        self.journal = journal.attach(self)
        self._ticker = threading.Thread(target=self._tick_loop, name="apc-lineage-tick", daemon=True)
        self._ticker.start()
        log.info("apc_lineage enabled layout=%s fingerprint=%s disk=%s entries_on_disk=%d",
                 self.layout.describe(), self.fingerprint[:16],
                 self.disk.root if self.disk else "off", len(self.cache.records()))

    def _record_event(self, event: Event) -> None:
        with self._event_lock:
            self._event_seq += 1
            item = (self._event_seq, time.time(), event)
            self.events.append(item)
        for listener in list(self.event_listeners):
            try:
                listener(*item)
            except Exception:
                pass

    def _tick_loop(self) -> None:
        """Idle entries go to disk in the background, never on the admission path."""
        while True:
            time.sleep(min(5.0, max(0.5, self.config.disk_write_delay_s / 4)))
            try:
                self.cache.tick()
            except Exception as exc:
                log.warning("apc_lineage tick failed: %s", exc)

    def flush(self, timeout: float | None = 60.0) -> int:
        """Queue every unwritten entry and wait for the writer; returns entries queued."""
        queued = self.cache.flush()
        if self.disk is not None:
            self.disk.flush(timeout)
        return queued


RUNTIMES: dict[int, LineageRuntime] = {}
_LOCK = threading.Lock()


def runtime_for(manager: Any, language_model: Any) -> LineageRuntime:
    """The runtime of ``manager`` (one per APC manager, i.e. per loaded model)."""
    with _LOCK:
        runtime = getattr(manager, "_apc_lineage_runtime", None)
        if runtime is None:
            runtime = LineageRuntime(language_model)
            manager._apc_lineage_runtime = runtime
            RUNTIMES[id(manager)] = runtime
            _clear_with(manager, runtime)
        return runtime


def _clear_with(manager: Any, runtime: LineageRuntime) -> None:
    """mlx-vlm's ``POST /v1/cache/reset`` calls ``manager.clear()`` (stock: its RAM entries
    go, its disk files stay): the lineage cache's RAM entries go with them, or an operator's
    reset would leave every lineage restorable."""
    stock_clear = manager.clear

    def clear() -> None:
        stock_clear()
        runtime.cache.clear()

    manager.clear = clear


def current() -> LineageRuntime | None:
    """The most recently created runtime (the server serves one text model at a time)."""
    with _LOCK:
        return next(reversed(RUNTIMES.values()), None) if RUNTIMES else None


def flush_all(timeout: float | None = None) -> None:
    """Write every runtime's unwritten entries (graceful shutdown), each for at most ``timeout``
    seconds (default: its ``shutdown_flush_s``)."""
    for runtime in list(RUNTIMES.values()):
        runtime.flush(runtime.config.shutdown_flush_s if timeout is None else timeout)
