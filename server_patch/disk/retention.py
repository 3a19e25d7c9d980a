"""A removed server's files in the shared disk tier: readable by its peers until the retention
limit, then collected (issue 38).

A server that leaves the fleet (``fleet down --server``, a crash, a machine taken away) leaves
its subdirectory behind: its peers keep restoring its sessions from it. Once nobody has held its
lock for ``APC_SHARED_DISK_RETENTION_S`` (measured from its newest file, and the lock checked
free), the first peer that scans it takes its lock, so a server starting there meanwhile is
never raced, and removes its lineage files; what stays (the lock file, an empty directory) costs
nothing. ``flock`` is per machine: on a filesystem several machines mount, a server running on
another machine does not hold the lock here, so the newest file's age is what protects it; keep
the retention well above a roll's length, or 0 (never collect) there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from server_patch.disk.integrity import SUFFIX
from server_patch.disk.lock import DiskInUse, DiskLock, holder

log = logging.getLogger("server_patch.disk")


def collect(server_dir: Path, peer_dir: Path, older_than: float) -> bool:
    """Remove ``peer_dir``'s lineage files when ``server_dir``'s server is gone and its newest
    file is older than ``older_than`` (epoch seconds); whether they were removed."""
    if holder(server_dir) is not None:
        return False  # its server runs
    try:
        files = [e for e in os.scandir(peer_dir) if e.name.endswith(SUFFIX)]
        newest = max((e.stat(follow_symlinks=False).st_mtime for e in files), default=None)
    except OSError:
        return False
    if newest is None or newest >= older_than:
        return False
    try:
        lock = DiskLock(server_dir).acquire()
    except (DiskInUse, OSError):
        return False  # it came back meanwhile
    try:
        for entry in files:
            Path(entry.path).unlink(missing_ok=True)
    finally:
        lock.release()
    log.warning("lineage shared disk: removed %d files of %s (its server gone past the retention)",
                len(files), server_dir)
    return True
