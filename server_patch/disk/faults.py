"""Test-only fault hooks for the disk writer, inert unless ``APC_TEST_FAULTS=1``.

The fault-injection suite (tests/fault/test_fault_disk.py) drives a real server with them:

* ``APC_TEST_FAULT_DISK_STALL_S=N``: every write sleeps N seconds after its temp file is
  written and before the rename, so a test can ``kill -9`` the server mid-write;
* ``APC_TEST_FAULT_DISK_ENOSPC=1``: every write fails there with ``ENOSPC`` (a full disk);
* ``APC_TEST_FAULT_DISK_LOAD_HOLD_FILE=PATH``: while PATH exists, a queued request's disk load
  (``integration.loading``, on the loader thread) waits before it reads, having written
  ``PATH.held`` (so a test knows the request is LOADING and releases it by removing PATH);
* ``APC_TEST_FAULT_STAGE_HOLD_FILE=PATH``: the same for a queued request's staged copy
  (``integration.staging``, on the stager thread): the request is STAGING meanwhile;
* ``APC_TEST_FAULT_JOIN_SPARES_HOLD_FILE=PATH``: the same for the making of a join's buffers
  ahead (``integration.joins_ahead``, on the stager thread): the finished joiner waits meanwhile.

Nothing else in the package reads these variables.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

from server_patch import settings


def during_write() -> None:
    """Called by the writer between writing the temp file and renaming it."""
    if not settings.value("APC_TEST_FAULTS"):
        return
    stall = settings.value("APC_TEST_FAULT_DISK_STALL_S")
    if stall > 0:
        time.sleep(stall)
    if settings.value("APC_TEST_FAULT_DISK_ENOSPC"):
        raise OSError(errno.ENOSPC, "No space left on device (APC_TEST_FAULT_DISK_ENOSPC)")


HOLD_MAX_S = 300.0  # a hold never outlives a test run


def before_load() -> None:
    """Called on the loader thread before a queued request's disk file is read."""
    _hold("APC_TEST_FAULT_DISK_LOAD_HOLD_FILE")


def before_stage() -> None:
    """Called on the stager thread before a queued request's rows are copied."""
    _hold("APC_TEST_FAULT_STAGE_HOLD_FILE")


def before_join_spares() -> None:
    """Called on the stager thread before a join's buffers are made ahead."""
    _hold("APC_TEST_FAULT_JOIN_SPARES_HOLD_FILE")


def _hold(variable: str) -> None:
    """While the file ``variable`` names exists (having written ``PATH.held``), wait."""
    if not settings.value("APC_TEST_FAULTS"):
        return
    path = settings.value(variable)
    if not path or not Path(path).exists():
        return
    Path(f"{path}.held").write_text("held\n")
    deadline = time.monotonic() + HOLD_MAX_S
    while Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
