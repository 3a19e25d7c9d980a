"""``POST /admin/flush``: write what RAM holds and the disk lacks, and say what reached the disk.

The policy's ``flush`` counts the entries it *queued*; a write refused at once (the free-space
floor, a backoff after a failure) or failing in the writer leaves its entry dirty. So the
answer is read back after the writer finished: ``written`` counts the files that reached the
disk meanwhile, ``unwritten`` lists the entries whose state RAM holds and the disk lacks (a
failed write, or one lent to a running request), and ``complete`` is true only when there are
none and the writer finished within the timeout. ``reason`` says why not. ``apcctl flush``
exits 1 on an incomplete flush, and ``apcctl restart`` stops nothing after one (unless forced).
"""

from __future__ import annotations

from typing import Any

from server_patch.admin.schema import FlushReport

LISTED = 50  # unwritten entry ids in the answer (the count is always exact)


def flush_report(runtime: Any, timeout: float) -> FlushReport:
    """Flush ``runtime``'s cache and wait up to ``timeout`` seconds for the writer."""
    disk = runtime.disk
    if disk is None:
        return FlushReport(queued=0, written=0, failed=0, unwritten=[], pending=0, complete=True, reason=None,
                           disk_enabled=False)
    stats = runtime.cache.stats
    before = int(stats.get("disk_writes", 0))
    queued = runtime.cache.flush()
    finished = disk.flush(timeout)
    written = int(stats.get("disk_writes", 0)) - before
    dirty = [e for e in runtime.cache.entries() if e.dirty]
    pending = 0 if finished else disk.pending
    return FlushReport(queued=queued, written=written, failed=len(dirty), unwritten=[e.id for e in dirty[:LISTED]],
                       pending=pending, complete=finished and not dirty,
                       reason=_reason(dirty, pending, timeout, disk), disk_enabled=True)


def _reason(dirty: list[Any], pending: int, timeout: float, disk: Any) -> str | None:
    reasons = []
    if pending:
        reasons.append(f"{pending} writes still queued after {timeout:g} s")
    lent = sum(1 for e in dirty if getattr(e, "lent", False))
    if lent:
        reasons.append(f"{lent} entries lent to a running request")
    if len(dirty) > lent:
        error = disk.guard.last_error or "the write failed"
        reasons.append(f"{len(dirty) - lent} entries not written: {error}")
    return "; ".join(reasons) or None
