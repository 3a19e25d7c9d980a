"""What the policy needs to know about stored state: its size, and how to detach a prefix.

The mlx plumbing (``server_patch.state``) hands the policy real cache states; the simulator
hands it sized placeholders. The policy never looks inside either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@runtime_checkable
class SnapshotHandle(Protocol):
    """The non-sliceable part of the cache (recurrent + conv state) at one token length."""

    @property
    def nbytes(self) -> int: ...


@runtime_checkable
class KVHandle(Protocol):
    """The append-only part of the cache: rows [:n] are the KV at n tokens.

    Its sizes are fixed for its life, except that a loan (``lent``) may end with other
    buffers behind the same rows (the borrower's, grown): the policy counts a lent entry's
    bytes again until its loan is over (``budget.RamTally``).
    """

    @property
    def nbytes(self) -> int:
        """Bytes of the rows [:n] themselves."""
        ...

    @property
    def held_nbytes(self) -> int:
        """Bytes holding the handle costs: the whole buffers behind the rows, spare rows
        included (what the RAM budget counts)."""
        ...

    @property
    def lent(self) -> bool:
        """Its rows are lent to a running request: not evictable, writable nor rewindable."""
        ...

    def prefix(self, length: int) -> "KVHandle":
        """An independent handle on rows [:length] (an anchor must outlive its lineage)."""
        ...

    def truncated(self, length: int) -> "KVHandle":
        """Rows [:length] of the same buffers, no copy (an entry whose head moves back to its
        prompt end, ``LineageCache.rewind``)."""
        ...


@dataclass(frozen=True)
class SizedSnapshot:
    """A snapshot that is only a size: the simulator's and the unit tests' stand-in."""

    nbytes: int


@dataclass(frozen=True)
class SizedKV:
    """KV rows that are only a size: ``bytes_per_token * length``."""

    bytes_per_token: int
    length: int

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.length

    @property
    def held_nbytes(self) -> int:
        return self.nbytes  # no spare rows

    @property
    def lent(self) -> bool:
        return False  # nothing to lend: the simulator copies nothing either way

    def prefix(self, length: int) -> "SizedKV":
        return SizedKV(self.bytes_per_token, min(length, self.length))

    def truncated(self, length: int) -> "SizedKV":
        """Rows [:length] of the same buffer (``LineageCache.rewind``); sized, so a new handle."""
        return self.prefix(length)
