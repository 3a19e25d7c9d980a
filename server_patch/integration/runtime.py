"""One lineage runtime per loaded model: the policy, its layout, disk tier, workers, timings, events.

Created lazily by the coordinator the first time a model is served (``runtime_for``, one per
APC manager) and adopted by the server's parts (``integration.parts``), through which the admin
endpoint, the canary and the shutdown flush reach it. Nothing here runs per token.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import numpy as np

from server_patch import clock, pacing
from server_patch.disk_paths import default_disk_root, disk_enabled
from server_patch.disk import peers
from server_patch.copyfree.spares import JointSpares
from server_patch.disk.loader import CHECKS_THREAD, THREAD_NAME as LOADER_THREAD, BackgroundLoads
from server_patch.disk.store import DiskStore, new_writer, own_stream
from server_patch.drift import DriftDetector, DriftSettings
from server_patch.integration import journal
from server_patch.integration.staging import STAGER_THREAD
from server_patch.infra.workers import Workers
from server_patch.integration.session import SessionBook
from server_patch.integration.timings import TimingBook
from server_patch.lineage import Event, LineageCache, LineageConfig, as_tokens
from server_patch.state import weights_hash
from server_patch.state.fingerprint import model_fingerprint
from server_patch.state.layout import CacheLayout
from server_patch.state import splits
from server_patch.state.options import kv_quant_of

if TYPE_CHECKING:
    from server_patch.boundaries import SegmentFinder, SegmentInfo
    from server_patch.canary.service import Canary

log = logging.getLogger("server_patch.lineage")

EVENT_RING = 4096


class LineageRuntime:
    """Everything the lineage cache needs for one model, and what /admin reads."""

    def __init__(self, language_model: Any, config: LineageConfig | None = None,
                 model_dir: Path | str | None = None) -> None:
        self.config = config or LineageConfig.from_env()
        self.layout = CacheLayout.from_model(language_model, kv_quant=kv_quant_of())
        splits.warn_once(splits.family_of(language_model), log.warning)
        weights, why_no_disk = _weights_of(model_dir)
        self.fingerprint = model_fingerprint(language_model, weights)
        self.started = clock.wall()
        self.events: deque[tuple[int, float, Event]] = deque(maxlen=EVENT_RING)
        self._event_seq = 0
        self._event_lock = threading.Lock()
        self.event_listeners: list[Callable[[int, float, Event], None]] = []
        self.pacer = pacing.from_env()  # decode-aware prefill chunks (``integration.hooks.prefill_step``)
        self.drift = DriftDetector(DriftSettings.from_env())  # what each client changed (``drift_of``)
        # The server's parts this runtime serves under, set when they adopt it (``parts.Runtimes``).
        self.finder: SegmentFinder | None = None
        self._boundaries: OrderedDict[tuple[int, int], SegmentInfo] = OrderedDict()  # the last few prompts'
        self.canary: Canary | None = None
        self.disk: DiskStore | None = None
        self.workers = Workers()  # its disk writer, ticker, loader and stager, closed with it (``infra.workers``)
        # Queued requests' disk loads (``integration.loading``) and staged copies
        # (``integration.staging``), each on a worker of its own (a copy never waits behind a load),
        # started now so a runtime borrows its threads once, from the park, where a replaced
        # runtime's are (each ran MLX work: its stream, made once per thread, is kept and reused).
        self.loads = _background(self.workers, LOADER_THREAD)
        self.stages = _background(self.workers, STAGER_THREAD)
        # The canary's checks load their files on a worker of their own (a request's load never
        # waits behind a check's, nor shares one of the same file): a check runs on the runtime's
        # cache and disk, so its loads are the runtime's too, closed with it. Its thread is
        # borrowed at the first check's load (a server without a canary borrows none).
        self.checks = _background(self.workers, CHECKS_THREAD, eager=False)
        # Joint batch buffers its stager makes ahead for a staged turn's join (``copyfree.spares``);
        # its generator's join takes them, its ticker drops those no join took.
        self.spares = JointSpares()
        # Those of its decoding batch's next regrow (``integration.grows_ahead``), its own set:
        # a join's and a regrow's may both be wanted at once.
        self.grow_spares = JointSpares(purpose="regrow")
        if disk_enabled() and why_no_disk:
            log.warning("apc_lineage: disk tier off for this run: %s", why_no_disk)
        elif disk_enabled():
            label = self.layout.kv_quant_label  # --kv-bits: its own directory, the float one kept
            root = default_disk_root() / (self.fingerprint[:16] + (f"-{label}" if label else ""))
            self.disk = DiskStore(root, fingerprint=self.fingerprint, layout=self.layout,
                                  writer=new_writer(self.workers).start())
            self.disk.peers = peers.attach(self.disk)  # the shared tier (issue 38), if configured
        self.cache = LineageCache(self.config, disk=self.disk, on_event=self._record_event, clock=clock.steady)
        self.spares.budget = self.grow_spares.budget = self.cache  # buffers made ahead count in its RAM budget
        # The one book of its requests' sessions, whose ring holds the finished timing records;
        # every coordinator of this runtime works in a scope of it (``SessionBook.scope``).
        self.book = SessionBook(release=self.cache.release)
        self.cache.misses.sequence_listeners.append(self.drift.observe_sequence)
        # Request records and cache events also go to the on-disk journal (apcctl report).
        self.journal = journal.attach(self)
        self._closed = threading.Event()
        self._ticker = self.workers.worker("apc-lineage-tick")
        self._ticker.submit(self._tick_loop)
        log.info("apc_lineage enabled layout=%s fingerprint=%s disk=%s entries_on_disk=%d",
                 self.layout.describe(), self.fingerprint[:16],
                 self.disk.root if self.disk else "off", len(self.cache.records()))

    def _record_event(self, event: Event) -> None:
        with self._event_lock:
            self._event_seq += 1
            item = (self._event_seq, clock.wall(), event)
            self.events.append(item)
        for listener in list(self.event_listeners):
            try:
                listener(*item)
            except Exception:
                pass

    def _tick_loop(self) -> None:
        """Idle entries go to disk in the background, never on the admission path."""
        while not self._closed.wait(min(5.0, max(0.5, self.config.disk_write_delay_s / 4))):
            try:
                self.cache.tick()
                if dropped := self.spares.drop_if_idle():
                    log.info("apc_copyfree dropped %d joint buffers made ahead that no join took", dropped)
            except Exception as exc:
                log.warning("apc_lineage tick failed: %s", exc)

    def flush(self, timeout: float | None = 60.0) -> int:
        """Queue every unwritten entry and wait for the writer; returns entries queued."""
        queued = self.cache.flush()
        if self.disk is not None:
            self.disk.flush(timeout)
        return queued

    def refuses(self, kind: str) -> bool:
        """Whether a request must prefill ``kind`` cold (a failed canary check, ``APC_CANARY_ON_FAIL=cold``)."""
        return self.canary is not None and self.canary.refuses(kind)

    def boundaries(self, prompt_token_ids: np.ndarray) -> SegmentInfo:
        """Anchor and segment boundaries of one prompt, from the server's boundary finder (the
        parts hand it over); a runtime no server built (a library caller) has one of its own,
        which has noted no request."""
        from server_patch.boundaries import SegmentFinder, SegmentSettings
        from server_patch.integration.segments import boundaries

        if self.finder is None:
            self.finder = SegmentFinder(SegmentSettings.from_env())
        # a request's lookup (``drift_of``) and its prefill planning ask for the same prompt
        key = (len(prompt_token_ids), hash(as_tokens(prompt_token_ids).tobytes()))
        if (found := self._boundaries.get(key)) is None:
            found = self._boundaries[key] = boundaries(prompt_token_ids, self.finder)
            while len(self._boundaries) > 8:
                self._boundaries.popitem(last=False)
        return found

    def drift_points(self, prompt: np.ndarray, namespace: str) -> list[int]:
        """Restore points absorbing what clients change (``DriftDetector.points``)."""
        from server_patch.boundaries import Kind

        template = self.finder.template if self.finder is not None else None
        gen_start = template.gen_start(as_tokens(prompt)) if template is not None else None
        blocks = [p for p, kind in self.boundaries(prompt).kinds.items() if kind == Kind.BLOCK]
        return self.drift.points(as_tokens(prompt), namespace, gen_start, blocks)

    def drift_of(self, prompt: np.ndarray, namespace: str) -> dict[str, Any]:
        """What ``prompt`` changed against the nearest earlier sequence of ``namespace`` (the
        request record's ``drift``, ``server_patch.drift``); {} when nothing, or off."""
        if not self.drift.config.enabled:
            return {}
        info = self.boundaries(prompt)
        assert self.finder is not None  # ``boundaries`` made one where none was handed over
        template = self.finder.template
        return self.drift.observe(prompt, namespace, kinds=info.kinds, gen_start=template.gen_start(prompt),
                                  decode=template.decoder())

    @property
    def timings(self) -> TimingBook:
        """The finished timing records: the ring of the runtime's one book (``/admin``, the journal)."""
        return self.book.timings

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self, timeout: float | None = None) -> None:
        """End this runtime, whose model is unloaded or replaced: unwritten entries are written
        (for at most ``timeout`` seconds, default ``shutdown_flush_s``; what is left is dropped),
        then the cache stores nothing more, the ticker ends, the disk store closes (refusing
        writes) and the journal closes, so the next runtime is the only one writing its
        directory. Idempotent."""
        if self._closed.is_set():
            return
        timeout = self.config.shutdown_flush_s if timeout is None else timeout
        try:
            self.cache.flush()
        except Exception as exc:
            log.warning("apc_lineage flush at close failed: %s", exc)
        self.cache.close()
        self._closed.set()
        self._ticker.close(timeout)
        complete = self.disk.close(timeout) if self.disk is not None else True
        self.workers.close(timeout)  # their threads go back to the park, for the next runtime
        self.spares.drop()  # a staged turn's joint buffers: no join of this runtime will take them
        self.grow_spares.drop()
        if self.journal is not None:
            self.journal.close()
        log.info("apc_lineage runtime %s closed (its model was unloaded); unwritten entries %s",
                 self.fingerprint[:16], "none" if complete else "dropped")


def _background(workers: Workers, name: str, *, eager: bool = True) -> BackgroundLoads:
    """Background jobs polled without waiting (``BackgroundLoads``) on a worker of ``workers``,
    whose thread is borrowed now (``eager``) or at its first job."""
    worker = workers.worker(name, setup=own_stream)
    return BackgroundLoads(name, submit=(worker.start() if eager else worker).call)


def _weights_of(model_dir: Path | str | None) -> tuple[str | None, str]:
    """The weight files' digest, and why the disk tier must stay off ("" when it may run):
    state keyed by weights that cannot be hashed, or that changed after this process started
    (the loaded bytes may be the old ones), must never be written or restored."""
    if model_dir is None:
        return None, "the model's weight files are unknown (no model_path), so they cannot key the disk files"
    try:
        changed = weights_hash.changed_since_start(Path(model_dir))
        if changed:
            return None, (f"weight files changed after the server started ({', '.join(p.name for p in changed)}); "
                          "restart it to serve (and cache) the new weights")
        return weights_hash.weights_digest(Path(model_dir), weights_hash.digest_cache_path()), ""
    except (weights_hash.WeightsUnreadable, ValueError) as exc:
        return None, str(exc)


class APCManagerView(Protocol):
    """What the patch reads of mlx-vlm's ``APCManager`` (untyped upstream): the field the
    overlay's ``apc.py`` edit adds to hold its lineage runtime."""

    lineage_runtime: Optional[LineageRuntime]


def runtime_for(manager: APCManagerView, language_model: Any, model_dir: Path | str | None = None) -> LineageRuntime:
    """The runtime of ``manager`` (one per APC manager, i.e. per loaded model), built on first
    use and kept in the manager's own ``lineage_runtime`` field (the overlay's ``apc.py`` edit
    adds it; ``POST /v1/cache/reset``'s ``manager.clear()`` clears it through the door);
    ``model_dir``: where its weights were loaded from (mlx-vlm's ``model.model_path``). The
    server's parts adopt it (``integration.parts.Runtimes``) once its coordinator exists."""
    with _BUILDING:
        if manager.lineage_runtime is None:
            manager.lineage_runtime = LineageRuntime(language_model, model_dir=model_dir)
        return manager.lineage_runtime


def runtime_of(manager: Optional[APCManagerView]) -> LineageRuntime | None:
    """The runtime ``runtime_for`` built for ``manager``, if any (None for stock APC)."""
    return manager.lineage_runtime if manager is not None else None


_BUILDING = threading.Lock()  # one runtime per manager even if two generators start at once
