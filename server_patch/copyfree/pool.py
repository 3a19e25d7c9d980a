"""MLX's buffer pool between prefill chunks, prompt batches and requests.

Stock 0.7.10 calls ``mx.clear_cache()`` after every prefill chunk and every prompt batch (and
after every non-streaming request), so the next large allocation (the batch merge, a cache
regrow) gets fresh pages from the OS and faults them in: at 0.5 GB that is 0.4-1 s on a CPU
host, against ~0.09 s for the same copy into a reused buffer. Here those clears run only with
``APC_POOL_CLEAR=1``. The pool stays bounded two ways: ``mx.set_cache_limit`` (``APC_POOL_LIMIT_GB``,
16 GB; on the CPU backend MLX's default limit is 32 MB, which would keep nothing) and a
background release after ``APC_POOL_IDLE_S`` seconds (60) without prefill work. Clears that
stock runs for memory pressure (``APCManager._make_room``), on errors, on request removal and
every ``MLX_VLM_BATCH_CACHE_EVAL_INTERVAL`` decode steps are unchanged.

MLX reuses a freed buffer only for an allocation of (nearly) the same size, which is why the
merge rounds its capacity to size buckets (``server_patch.copyfree.merge.capacity``).

The pool is the process's, so this module's state is too, on purpose: MLX keeps one buffer pool
per process (``mx.set_cache_limit`` and ``mx.clear_cache`` act on all of it), whichever runtime
allocated, and its settings come from the process's environment. It holds no runtime's buffers:
a runtime's joint buffers made ahead are its own (``LineageRuntime.spares``, ``copyfree.spares``).
"""

from __future__ import annotations

import logging
import threading
import time

import mlx.core as mx

from server_patch.copyfree.settings import CopyFreeSettings

log = logging.getLogger("server_patch.copyfree")

_lock = threading.Lock()
_settings: CopyFreeSettings | None = None
_last_activity = time.monotonic()
_released_at = 0.0
_skipped: dict[str, int] = {}
_cleared: dict[str, int] = {}


def configure(settings: CopyFreeSettings | None = None) -> CopyFreeSettings:
    """Apply the pool settings once per process (later calls return the first settings)."""
    global _settings
    with _lock:
        if _settings is not None:
            return _settings
        _settings = settings or CopyFreeSettings.from_env()
        previous = mx.set_cache_limit(int(_settings.pool_limit_gb * (1 << 30)))
        if _settings.pool_idle_s > 0:
            threading.Thread(target=_idle_loop, name="apc-pool-idle", daemon=True).start()
    log.info("apc_copyfree pool limit=%.1fGB (was %.2fGB) clear_per_batch=%s idle_release_s=%s",
             _settings.pool_limit_gb, previous / (1 << 30), _settings.pool_clear, _settings.pool_idle_s)
    return _settings


def settings() -> CopyFreeSettings:
    return _settings if _settings is not None else configure()


def reconfigure(settings: CopyFreeSettings) -> None:
    """Replace the settings (tests and tools); the idle thread, once started, keeps running."""
    global _settings
    with _lock:
        started = _settings is not None and _settings.pool_idle_s > 0
        _settings = settings
    mx.set_cache_limit(int(settings.pool_limit_gb * (1 << 30)))
    if settings.pool_idle_s > 0 and not started:
        threading.Thread(target=_idle_loop, name="apc-pool-idle", daemon=True).start()


def touch() -> None:
    """Note prefill or request activity (the idle release waits for a quiet period)."""
    global _last_activity
    _last_activity = time.monotonic()


def clear(site: str) -> None:
    """Stock's per-chunk / per-batch / per-request ``mx.clear_cache()``, now opt-in."""
    touch()
    if settings().pool_clear:
        mx.clear_cache()
        _cleared[site] = _cleared.get(site, 0) + 1
    else:
        _skipped[site] = _skipped.get(site, 0) + 1


def stats() -> dict[str, object]:
    """What the pool holds and which clears ran or were skipped, by call site."""
    return {"cache_bytes": int(mx.get_cache_memory()), "active_bytes": int(mx.get_active_memory()),
            "cleared": dict(_cleared), "skipped": dict(_skipped), "idle_released_at": _released_at}


def idle(now: float | None = None) -> bool:
    """Whether nothing used the pool for ``pool_idle_s`` seconds (never, with the release off):
    when it is released, and when a runtime drops the joint buffers no join took
    (``copyfree.spares.JointSpares.drop_if_idle``, on the runtime's ticker)."""
    idle_s = settings().pool_idle_s
    now = time.monotonic() if now is None else now
    return idle_s > 0 and now - _last_activity >= idle_s


def release_if_idle(now: float | None = None) -> bool:
    """Release the pool when nothing used it for ``pool_idle_s`` seconds; True if released."""
    global _released_at
    now = time.monotonic() if now is None else now
    if not idle(now) or _released_at >= _last_activity:
        return False
    held = mx.get_cache_memory()
    _released_at = now
    if held:
        mx.clear_cache()
        log.info("apc_copyfree pool released %.1f MB after %.0f s idle", held / 1e6, now - _last_activity)
    return bool(held)


def _idle_loop() -> None:
    while True:
        idle_s = settings().pool_idle_s
        time.sleep(min(5.0, max(0.25, idle_s / 4)))
        try:
            release_if_idle()
        except Exception as exc:  # never take the server down for a pool release
            log.warning("apc_copyfree idle release failed: %s", exc)
