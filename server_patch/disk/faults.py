"""Test-only fault hooks for the disk writer, inert unless ``APC_TEST_FAULTS=1``.

The fault-injection suite (tests/test_fault_disk.py) drives a real server with them:

* ``APC_TEST_FAULT_DISK_STALL_S=N``: every write sleeps N seconds after its temp file is
  written and before the rename, so a test can ``kill -9`` the server mid-write;
* ``APC_TEST_FAULT_DISK_ENOSPC=1``: every write fails there with ``ENOSPC`` (a full disk).

Nothing else in the package reads these variables.
"""

from __future__ import annotations

import errno
import time

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
