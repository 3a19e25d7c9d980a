"""What every simulated cache policy answers, and the byte ledger it keeps.

A policy serves one request at a time: it says how many prompt tokens it restored, then stores
whatever its rules store. Reused + computed = prompt tokens always; a policy never reuses the
last token (0.7.10 feeds it to the first decode step), so reuse is capped at n - 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from apcctl.lab.sim.trace import Request


@dataclass(frozen=True)
class Served:
    """How a request was served: tokens restored and where from (``cold``, ``ram:entry``, ...)."""

    reused: int
    source: str


@dataclass
class Ledger:
    """Traffic a policy caused. Held bytes are sampled by the replay loop, not kept here."""

    bytes_cloned: int = 0  # copies made to store state (restore copies are not counted)
    disk_bytes_written: int = 0
    disk_bytes_deleted: int = 0
    disk_bytes_read: int = 0
    evictions: int = 0  # conversation state dropped from RAM for space or count
    anchor_evictions: int = 0  # pinned system-prompt entries dropped (lineage only)
    disk_evictions: int = 0  # files deleted by the disk cap (not supersession)
    ram_skips: int = 0  # snapshots too big for the RAM tier, written straight to disk (stock)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Policy(Protocol):
    """A cache policy under replay. ``finish`` runs once after the last request."""

    name: str
    ledger: Ledger

    def serve(self, req: Request) -> Served: ...

    def finish(self, end_time: float) -> None: ...

    def ram_bytes(self) -> int: ...

    def disk_bytes(self) -> int: ...

    def checkpoint_bytes(self) -> int:
        """Bytes held in secondary restore points (not any lineage's latest state)."""
        ...
