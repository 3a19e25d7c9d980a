"""When the disk writer may try: never below the free-space floor, not while backing off.

A full disk fails every write; retrying at every idle tick would spin on the same error and
flood the log. After a failure the next attempt waits 1 s, then 2 s, 4 s ... up to 5 min; a
success resets it. The floor (``APC_LINEAGE_DISK_MIN_FREE``, default 5 % of the volume) keeps
the cache from being what fills the disk: below it no write is attempted.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Mapping

from server_patch import settings

log = logging.getLogger("server_patch.disk")

MIN_FREE_ENV = "APC_LINEAGE_DISK_MIN_FREE"
DEFAULT_MIN_FREE = settings.setting(MIN_FREE_ENV).default
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 300.0


class DiskUnavailable(OSError):
    """A write that was not attempted: backing off after a failure, or below the floor."""


def parse_min_free(raw: str | None) -> float:
    """``"5%"`` or ``"0.05"`` -> 0.05; unset -> the default. Anything else is a ValueError."""
    if raw is None or not raw.strip():
        return DEFAULT_MIN_FREE
    return settings.setting(MIN_FREE_ENV).parse(raw)


def min_free_from_env(env: Mapping[str, str] | None = None) -> float:
    return settings.value(MIN_FREE_ENV, env)


class WriteGuard:
    """Admission for disk writes; ``stats`` counts attempts, failures and writes not attempted."""

    def __init__(self, root: Path, min_free: float = DEFAULT_MIN_FREE, *,
                 clock: Callable[[], float] = time.monotonic,
                 usage: Callable[[Path], tuple[int, int, int]] = shutil.disk_usage) -> None:
        self.root = root
        self.min_free = min_free
        self.clock = clock
        self.usage = usage
        self.stats: Counter[str] = Counter()
        self.delay_s = 0.0  # the current backoff (0: none)
        self.last_error = ""
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def retry_in(self) -> float:
        """Seconds until the next write may be attempted (0 when it may now)."""
        return max(0.0, self._retry_at - self.clock())

    def admit(self, need_bytes: int = 0) -> None:
        """Raise ``DiskUnavailable`` unless a write of ``need_bytes`` may be attempted now."""
        with self._lock:
            wait = self._retry_at - self.clock()
            if wait > 0:
                self.stats["deferred"] += 1
                raise DiskUnavailable(f"disk writes paused for {wait:.1f} s after: {self.last_error}")
        self._check_floor(need_bytes)

    def _check_floor(self, need_bytes: int) -> None:
        if self.min_free <= 0:
            return
        try:
            total, _, free = self.usage(self.root)
        except OSError as exc:
            raise self._refuse(f"cannot read free space of {self.root}: {exc}") from None
        if free - need_bytes < self.min_free * total:
            after = f" after writing {need_bytes} bytes" if need_bytes else ""
            raise self._refuse(f"free space{after} would be {(free - need_bytes) / max(total, 1):.1%} of the "
                               f"volume, below the floor {self.min_free:.1%} ({MIN_FREE_ENV})")

    def _refuse(self, reason: str) -> DiskUnavailable:
        self.stats["floor"] += 1
        self.failed(reason)
        return DiskUnavailable(reason)

    def attempted(self) -> None:
        with self._lock:
            self.stats["attempts"] += 1

    def failed(self, error: object) -> float:
        """Start or double the backoff after a failure; returns the delay."""
        with self._lock:
            self.stats["failures"] += 1
            self.delay_s = BACKOFF_FIRST_S if self.delay_s <= 0 else min(BACKOFF_MAX_S, self.delay_s * 2)
            self._retry_at = self.clock() + self.delay_s
            self.last_error = str(error)
            delay = self.delay_s
        log.warning("lineage disk: write failed (%s); backing off, next attempt in %g s",
                    self.last_error, delay)
        return delay

    def succeeded(self) -> None:
        with self._lock:
            if self.delay_s > 0:
                log.info("lineage disk: writes succeed again")
            self.delay_s = 0.0
            self._retry_at = 0.0
            self.last_error = ""
