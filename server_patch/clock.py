"""The server's clocks: ``monotonic`` for intervals, ``wall`` only for what is shown or journaled.

A wall clock stepped back an hour (NTP after a suspend, an operator) kept entries RAM-only for
an hour when the write-behind, the LRU order and the canary's idle test read it. So intervals
use ``time.monotonic``. The lineage cache's ``created``/``last_used`` are both: shown as times
("5 s ago") and subtracted as intervals, so they read ``steady``: a monotonic clock anchored to
the wall clock once, when this module is imported; a step after that does not move it.

Test fault (inert unless ``APC_TEST_FAULTS=1``): ``APC_TEST_FAULT_CLOCK_STEP_FILE`` names a
file holding seconds added to ``wall()``, read on every call, so a test steps the real server's
wall clock while it runs (tests/fault/test_fault_clock.py). Nothing in ``server_patch`` but this
module reads ``time.time`` (a test keeps it so).
"""

from __future__ import annotations

import time

from server_patch import settings

monotonic = time.monotonic


def _step_file() -> str | None:
    if not settings.value("APC_TEST_FAULTS"):
        return None
    path = settings.value("APC_TEST_FAULT_CLOCK_STEP_FILE")
    return str(path) if path else None


_STEP_FILE = _step_file()


def _step() -> float:
    try:
        with open(_STEP_FILE, encoding="ascii") as f:  # type: ignore[arg-type]
            return float(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0.0


def wall() -> float:
    """Seconds since the epoch, for display and journals only (it may step)."""
    return time.time() + (_step() if _STEP_FILE else 0.0)


_ANCHOR = wall() - time.monotonic()


def steady() -> float:
    """Monotonic seconds that read as wall-clock time of the process's start plus elapsed."""
    return _ANCHOR + time.monotonic()
