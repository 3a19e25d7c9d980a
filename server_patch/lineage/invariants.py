"""What must hold of the cache between any two verbs (``LineageCache.check``).

A bug that breaks one of these does not crash: the server fails closed and prefills cold, or
a budget drifts. So the tests check them after every verb, and a debug server could too: one
pass over the entries, their checkpoints, the files and the supersede map, no mlx work.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from server_patch.lineage.budget import WriteQueue
from server_patch.lineage.holds import Holds
from server_patch.lineage.model import Entry, Loan
from server_patch.lineage.tally import EntryMap, RecordMap


class InvariantError(AssertionError):
    """The cache's state broke an invariant; ``violations`` names every one found."""

    def __init__(self, violations: list[str]) -> None:
        super().__init__("lineage cache invariants broken:\n  " + "\n  ".join(violations))
        self.violations = violations


def tally_violations(entries: EntryMap, records: RecordMap) -> list[str]:
    """The running byte counts equal what re-summing the entries and files gives."""
    found = []
    total = entries.total  # recounts entries counted while lent (``tally``)
    for entry_id, entry in entries.items():
        if entries.counted(entry_id) != entry.nbytes:
            found.append(f"entry {entry_id}: counted {entries.counted(entry_id)} bytes, holds {entry.nbytes}")
    if total != sum(e.nbytes for e in entries.values()):
        found.append(f"RAM tally {total} != {sum(e.nbytes for e in entries.values())} bytes held")
    on_disk = sum(r.nbytes for r in records.values())
    if records.total != on_disk:
        found.append(f"disk tally {records.total} != {on_disk} bytes of files")
    return found


def entry_violations(entry: Entry) -> list[str]:
    """Checkpoints sorted, unique, inside the entry; the protected prompt end present."""
    found = []
    lengths = [c.length for c in entry.checkpoints]
    if any(a >= b for a, b in zip(lengths, lengths[1:])):
        found.append(f"entry {entry.id}: checkpoints not sorted and unique: {lengths}")
    outside = [n for n in lengths if not 0 < n < entry.length]
    if outside:
        found.append(f"entry {entry.id}: checkpoints {outside} not inside its {entry.length} tokens")
    if entry.prompt_end:  # reply reuse: the head sits past the reply, the prompt end is a checkpoint
        if not 0 < entry.prompt_end < entry.length:
            found.append(f"entry {entry.id}: prompt end {entry.prompt_end} not inside its {entry.length} tokens")
        elif entry.prompt_end not in lengths:
            found.append(f"entry {entry.id}: prompt end {entry.prompt_end} has no checkpoint")
    if entry.id in entry.supersedes:
        found.append(f"entry {entry.id}: supersedes its own file")
    return found


def queue_violations(entries: Iterable[Entry], queued: WriteQueue) -> list[str]:
    """No lent entry is queued for writing (its rows belong to a running request)."""
    return [f"entry {e.id}: lent and queued for writing" for e in entries if e.lent and queued.holds(e.id)]


def loan_violations(entries: EntryMap, loans: Iterable[Loan]) -> list[str]:
    """Loans are counted on their entries (``Entry.loans``, one receipt each: ``loans`` are the
    cache's holds of kind ``LENT``), and a stored entry's buffer is lent only under a receipt."""
    found = []
    out: dict[str, int] = {}
    for loan in loans:
        if loan.ended:
            found.append(f"entry {loan.entry.id}: an ended loan is still out")
        if entries.get(loan.entry.id) is loan.entry:
            out[loan.entry.id] = out.get(loan.entry.id, 0) + 1
    for entry_id, entry in entries.items():
        if entry.loans != out.get(entry_id, 0):
            found.append(f"entry {entry_id}: counts {entry.loans} loans, {out.get(entry_id, 0)} receipts out")
        if getattr(entry.kv, "lent", False) and not entry.lent:
            found.append(f"entry {entry_id}: its buffer is lent without a receipt")
    return found


def supersede_cycles(superseded_by: Mapping[str, str]) -> list[str]:
    """The supersede chains (absorbed id -> absorber id) end: no cycle."""
    found, done = [], set()
    for start in superseded_by:
        path: list[str] = []
        on_path: set[str] = set()
        current: str | None = start
        while current is not None and current not in done:
            if current in on_path:
                cycle = path[path.index(current):] + [current]
                found.append("supersede cycle: " + " -> ".join(cycle))
                break
            path.append(current)
            on_path.add(current)
            current = superseded_by.get(current)
        done.update(path)
    return found


def hold_violations(entries: EntryMap, holds: Holds) -> list[str]:
    """A hold that pins an entry (``holds``) names one in RAM: a held entry never left it."""
    return [f"entry {entry_id}: held in RAM by a request but not in RAM" for entry_id in holds.resident_ids()
            if entry_id not in entries]


def violations(entries: EntryMap, records: RecordMap, queued: WriteQueue,
               superseded_by: Mapping[str, str]) -> list[str]:
    """Every invariant the cache's parts break, in words (empty: all hold)."""
    found = tally_violations(entries, records)
    for entry in entries.values():
        found.extend(entry_violations(entry))
    found.extend(queue_violations(entries.values(), queued))
    found.extend(supersede_cycles(superseded_by))
    return found


__all__ = ["InvariantError", "hold_violations", "loan_violations", "violations"]
