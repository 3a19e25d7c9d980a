"""When the disk writer may try: never below the free-space floor, not while backing off.

A full disk fails every write; retrying at every idle tick would spin on the same error and
flood the log. After a failure the next attempt waits 1 s, then 2 s, 4 s ... up to 5 min; a
success resets it. The floor (``APC_LINEAGE_DISK_MIN_FREE``, default 5 % of the volume) keeps
the cache from being what fills the disk: below it no write is attempted.

Reading the free space is a ``statvfs`` call, file-system I/O that a slow or hung volume (a
network mount) can stall, so it never runs on the generation thread (issue 29). A commit
queues its write after ``admit_queued``, which reads only the backoff state. The writer thread
reads the real free space before each write (``admit``, with the file's size) and again after
it (``after_write``): a volume found below the floor then pauses writes as a failure does, so
the commits that follow are refused at once from that state, and the first write queued after
the pause is checked against the real free space again before any file is opened.
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

    def admit_queued(self) -> None:
        """The commit path's check (no I/O): raise ``DiskUnavailable`` while writes back off
        after a failure or a volume found below the floor; the writer checks the real free
        space before it writes (``admit``)."""
        with self._lock:
            wait = self._retry_at - self.clock()
            if wait > 0:
                self.stats["deferred"] += 1
                raise DiskUnavailable(f"disk writes paused for {wait:.1f} s after: {self.last_error}")

    def admit(self, need_bytes: int = 0) -> None:
        """Raise ``DiskUnavailable`` unless a write of ``need_bytes`` may be attempted now
        (on the writer thread: it reads the volume's free space)."""
        self.admit_queued()
        self._check_floor(need_bytes)

    def after_write(self) -> None:
        """On the writer thread, after a write: a volume now below the floor pauses writes,
        so the commits that follow are refused without reading it (``admit_queued``)."""
        if (short := self._below_floor(0)) is not None:
            self._pause(short)

    def _check_floor(self, need_bytes: int) -> None:
        if (short := self._below_floor(need_bytes)) is not None:
            raise self._refuse(short)

    def _below_floor(self, need_bytes: int) -> str | None:
        """Why a write of ``need_bytes`` would cross the floor now, or None if it would not."""
        if self.min_free <= 0:
            return None
        try:
            total, _, free = self.usage(self.root)
        except OSError as exc:
            return f"cannot read free space of {self.root}: {exc}"
        if free - need_bytes < self.min_free * total:
            after = f" after writing {need_bytes} bytes" if need_bytes else ""
            return (f"free space{after} would be {(free - need_bytes) / max(total, 1):.1%} of the "
                    f"volume, below the floor {self.min_free:.1%} ({MIN_FREE_ENV})")
        return None

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
        return self._pause(error, "write failed")

    def _pause(self, error: object, what: str = "below the free-space floor after a write") -> float:
        """Start or double the backoff; returns the delay."""
        with self._lock:
            self.delay_s = BACKOFF_FIRST_S if self.delay_s <= 0 else min(BACKOFF_MAX_S, self.delay_s * 2)
            self._retry_at = self.clock() + self.delay_s
            self.last_error = str(error)
            delay = self.delay_s
        log.warning("lineage disk: %s (%s); backing off, next attempt in %g s", what, self.last_error, delay)
        return delay

    def succeeded(self) -> None:
        with self._lock:
            if self.delay_s > 0:
                log.info("lineage disk: writes succeed again")
            self.delay_s = 0.0
            self._retry_at = 0.0
            self.last_error = ""

