"""The post's old design: a guard snapshot at n - 16 and a full snapshot at n, every request.

Upstream before 0.7.10 (9b13f522: guard "16", ``generate()`` always committed the full prompt).
Each is a full clone; 8 RAM entries, LRU, no byte cap; every snapshot written to a disk tier
that the post saw grow to ~939 GB, modelled as a 1 TiB cap. It stores the same 0.7.10 cache
contents as stock (projected cache included): only the placement rules differ.
"""

from __future__ import annotations

from apcctl.lab.sim.policies.exact import GIB, ExactSnapshotPolicy
from apcctl.lab.sim.sizes import StateSizes

GUARD_TOKENS = 16
RAM_ENTRIES = 8
DISK_MAX_BYTES = 1024 * GIB


def post_store_points(n: int, prefix: int) -> list[tuple[int, bool]]:
    """(length, secondary): the resend guard at n - 16 if still uncached, and always n."""
    points = [(n, False)]
    if n - GUARD_TOKENS > prefix:
        points.insert(0, (n - GUARD_TOKENS, True))
    return points


def make_post_baseline(sizes: StateSizes) -> ExactSnapshotPolicy:
    return ExactSnapshotPolicy("post-baseline", sizes, post_store_points, ram_entries=RAM_ENTRIES,
                               ram_max_bytes=None, disk_max_bytes=DISK_MAX_BYTES)
