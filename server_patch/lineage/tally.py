"""Running byte totals of what the cache holds, kept where entries and files come and go.

Summing ``Entry.nbytes`` walks every layer of every KV and snapshot handle; the budgets are
read on every commit, eviction pass and status poll. So the maps the policy stores entries
and disk records in count bytes as they change: an insert or a removal adjusts the total,
and the policy calls ``EntryMap.resized`` after it changes a stored entry in place (a
checkpoint added or thinned, a rewind, a pin). The one change the policy does not make
itself is the end of a loan (``KVHandle.lent``), which may leave other buffers behind the
rows: an entry counted while lent is counted again at every read until its loan is over.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable, Generic, Iterator, TypeVar, ValuesView

from server_patch.lineage.model import DiskRecord, Entry

T = TypeVar("T")


class SizedMap(MutableMapping[str, T], Generic[T]):
    """A dict by id that keeps the sum of ``size(value)`` over its values."""

    def __init__(self, size: Callable[[T], int]) -> None:
        self._items: dict[str, T] = {}
        self._bytes: dict[str, int] = {}
        self._size = size
        self._total = 0

    @property
    def total(self) -> int:
        return self._total

    def counted(self, key: str) -> int:
        """The bytes counted for ``key`` (0 if absent)."""
        return self._bytes.get(key, 0)

    def __getitem__(self, key: str) -> T:
        return self._items[key]

    def __setitem__(self, key: str, value: T) -> None:
        if key in self._items:
            self._forget(key)
        self._items[key] = value
        self._count(key, value)

    def __delitem__(self, key: str) -> None:
        del self._items[key]
        self._forget(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: str, default: T | None = None) -> T | None:  # type: ignore[override]
        return self._items.get(key, default)

    def values(self) -> ValuesView[T]:
        return self._items.values()

    def clear(self) -> None:
        self._items.clear()
        self._bytes.clear()
        self._total = 0

    def _count(self, key: str, value: T) -> None:
        nbytes = int(self._size(value))
        self._bytes[key] = nbytes
        self._total += nbytes

    def _forget(self, key: str) -> None:
        self._total -= self._bytes.pop(key, 0)


class RecordMap(SizedMap[DiskRecord]):
    """The disk index: a record's size is its file's, fixed once written."""

    def __init__(self) -> None:
        super().__init__(lambda record: record.nbytes)
        self._pinned: set[str] = set()  # ids of pinned anchors' files (a header is fixed once written)

    def pinned_anchors_outside(self, held: SizedMap[Entry]) -> int:
        """Pinned anchors whose file is all there is of them (not in ``held``, the RAM entries):
        after a restart every anchor is, until a request restores it."""
        return sum(1 for key in self._pinned if key not in held)

    def clear(self) -> None:
        super().clear()
        self._pinned.clear()

    def _count(self, key: str, value: DiskRecord) -> None:
        super()._count(key, value)
        if value.is_anchor and value.pinned:
            self._pinned.add(key)

    def _forget(self, key: str) -> None:
        super()._forget(key)
        self._pinned.discard(key)


class EntryMap(SizedMap[Entry]):
    """The entries in RAM, with their bytes (``Entry.nbytes``), and which are anchors."""

    def __init__(self) -> None:
        super().__init__(lambda entry: entry.nbytes)
        self._anchors: set[str] = set()  # ids of entries that were anchors when counted
        self._loaned: set[str] = set()  # ids of entries counted while their rows were lent

    @property
    def total(self) -> int:
        self._recount_loaned()
        return self._total

    def resized(self, entry: Entry) -> None:
        """Count ``entry`` again after an in-place change (no-op unless it is stored)."""
        if self._items.get(entry.id) is entry:
            self._forget(entry.id)
            self._count(entry.id, entry)

    def pinned_anchors(self) -> list[Entry]:
        """The pinned anchors (``pinned`` may be set from outside: read, not counted)."""
        self._recount_loaned()
        anchors = (self._items[i] for i in self._anchors)
        return [e for e in anchors if e.is_anchor and e.pinned]

    def clear(self) -> None:
        super().clear()
        self._anchors.clear()
        self._loaned.clear()

    def _count(self, key: str, value: Entry) -> None:
        super()._count(key, value)
        if value.is_anchor:
            self._anchors.add(key)
        if value.lent:
            self._loaned.add(key)

    def _forget(self, key: str) -> None:
        super()._forget(key)
        self._anchors.discard(key)
        self._loaned.discard(key)

    def _recount_loaned(self) -> None:
        for key in list(self._loaned):
            self.resized(self._items[key])


__all__ = ["EntryMap", "RecordMap", "SizedMap"]
