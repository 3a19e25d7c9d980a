"""mlx-vlm 0.7.10's exact mode at its defaults (APC internals §1-3).

Snapshots sit at n - 1 (guard 1: the last prompt token goes through the first decode step),
plus the last multiple of 2048 below n - 1 when the prefill crosses it: on every cold prompt
and on warm prompts that cross a boundary (``checkpoint_lengths`` with two entries). Nothing
at or below the restored prefix is stored again, so an identical resend stores nothing. RAM:
2 entries and min(8 GiB, working set / 10) = 8 GiB on the Mac Studio; disk: 20 GiB.
"""

from __future__ import annotations

from apcctl.lab.sim.policies.exact import GIB, ExactSnapshotPolicy
from apcctl.lab.sim.sizes import StateSizes

GUARD_TOKENS = 1  # APC_CHECKPOINT_GUARD_TOKENS
INTERVAL_TOKENS = 2048  # APC_CHECKPOINT_INTERVAL_TOKENS
RAM_ENTRIES = 2  # APC_CHECKPOINT_ENTRIES
RAM_MAX_BYTES = 8 * GIB  # APC_MEMORY_MAX_GB automatic cap
DISK_MAX_BYTES = 20 * GIB  # APC_DISK_MAX_GB


def stock_store_points(n: int, prefix: int) -> list[tuple[int, bool]]:
    """(length, secondary): the interval checkpoint (if any) first, then n - 1."""
    final = n - GUARD_TOKENS
    last = ((final - 1) // INTERVAL_TOKENS) * INTERVAL_TOKENS
    points = []
    if INTERVAL_TOKENS <= last < final:
        points.append((last, True))
    points.append((final, False))
    return [(length, secondary) for length, secondary in points if length > prefix]


def make_stock(sizes: StateSizes) -> ExactSnapshotPolicy:
    return ExactSnapshotPolicy("stock", sizes, stock_store_points, ram_entries=RAM_ENTRIES,
                               ram_max_bytes=RAM_MAX_BYTES, disk_max_bytes=DISK_MAX_BYTES)
