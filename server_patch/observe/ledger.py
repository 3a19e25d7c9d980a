"""The copy ledger: running byte totals of cache copies, by ``op.kind``.

The serving path calls only this module (``enabled``, ``add``, ``mark``, ``since``); it costs
one flag test while the copy counter is off. What fills it is the instrumentation in
``server_patch.copyfree.counter``, which the launcher installs (``--copy-counter`` or
``APC_COPY_COUNTER=1``) and which switches the ledger on. This module imports no mlx and reads no environment, so
plumbing may import it without pulling a debug tool into the server.

Per request: ``mark()`` at lookup, ``since(mark)`` at the first token; the delta goes into
the request's timing record (``/admin/requests`` serves it as ``copies``). Every copy in the
process counts, so a delta is one request's own only while it is the only request in flight.

``LEDGER`` is the process's, on purpose (issue 35 kept it so): the counter that fills it wraps
mlx-vlm's cache classes for the whole process (stock mlx-vlm too, where no runtime exists), so a
copy it counts names no runtime, and ``apcctl bench ttft`` reads one file per process. It holds
byte totals of a debug tool, off by default, and nothing a runtime serves from: two runtimes in
one process add to the same totals, which a delta reports as they are (both runtimes' copies).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

Totals = dict[str, int]


class CopyLedger:
    """Byte totals by ``op.kind``; optionally mirrored to a JSON file after every change
    (``apcctl bench ttft`` reads that file from outside the server process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: Totals = {}
        self._on = False
        self._file: Path | None = None

    def switch_on(self, file: str | os.PathLike[str] | None = None) -> None:
        """Start counting; ``file`` (None: none) is rewritten after every counted copy."""
        with self._lock:
            self._file = Path(file) if file else None
            self._on = True

    def enabled(self) -> bool:
        return self._on

    def add(self, op: str, nbytes: int, *, kind: str = "kv") -> None:
        """Count ``nbytes`` copied by ``op`` (a no-op while off or for nothing copied)."""
        if not self._on or nbytes <= 0:
            return
        key = f"{op}.{kind}"
        with self._lock:
            self._totals[key] = self._totals.get(key, 0) + int(nbytes)
            self._write_locked()

    def snapshot(self) -> Totals:
        with self._lock:
            return dict(self._totals)

    def mark(self) -> Totals | None:
        """The running totals now (None, at no cost, while off)."""
        return self.snapshot() if self._on else None

    def since(self, before: Totals | None) -> Totals:
        """Bytes by ``op.kind`` counted since ``before`` (a ``mark()``); {} for no mark."""
        return {} if before is None else delta(self.snapshot(), before)

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()
            self._write_locked()

    def _write_locked(self) -> None:
        if self._file is None:
            return
        tmp = self._file.with_suffix(self._file.suffix + ".tmp")
        tmp.write_text(json.dumps(self._totals, sort_keys=True))
        os.replace(tmp, self._file)


def delta(after: Totals, before: Totals) -> Totals:
    """The totals that changed from ``before`` to ``after``, as differences."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


LEDGER = CopyLedger()  # the process's one ledger: copies anywhere in the process count here

switch_on = LEDGER.switch_on
enabled = LEDGER.enabled
add = LEDGER.add
snapshot = LEDGER.snapshot
mark = LEDGER.mark
since = LEDGER.since
reset = LEDGER.reset
