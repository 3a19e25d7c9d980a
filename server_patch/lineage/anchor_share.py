"""Which pinned anchors leave RAM when the anchor caps are exceeded: fair shares, not one LRU.

The caps (``anchor_max_entries``, ``anchor_max_bytes``) are shared by every namespace. With one
least-recently-used order across them, one API key that keeps sending new system prompts pushed
every other key's anchors out of RAM. So each time the caps are exceeded, the anchor to leave is
the least recently used one of the *holder* with the largest share (by the measure that is over:
count, else bytes): a key flooding anchors only ever loses its own while it holds more than the
others, and every holder keeps at least an equal share of the caps (max-min fairness). With one
holder it is the plain LRU order.

A holder is an API key (its tenants and salts share one share: a key cannot multiply its share
by inventing tenants), else the namespace itself (``tenancy.namespace.share_holder``).
"""

from __future__ import annotations

from typing import Callable, Iterable

from server_patch.lineage.model import Entry
from server_patch.tenancy.namespace import share_holder


def over_cap(anchors: Iterable[Entry], *, size: Callable[[Entry], int], evictable: Callable[[Entry], bool],
             max_entries: int, max_bytes: int) -> list[Entry]:
    """The anchors to evict, in order, so that count and bytes fit the caps where they can (anchors
    that cannot leave, lent or being written, stay and still count)."""
    held: dict[str, list[Entry]] = {}
    for anchor in sorted(anchors, key=lambda e: e.last_used):
        held.setdefault(share_holder(anchor.namespace), []).append(anchor)
    count = sum(len(group) for group in held.values())
    nbytes = sum(size(a) for group in held.values() for a in group)
    usage = {h: [len(group), sum(size(a) for a in group)] for h, group in held.items()}
    victims: list[Entry] = []
    while count > max_entries or nbytes > max_bytes:
        measure = 0 if count > max_entries else 1
        movable: dict[str, Entry] = {}
        for h, group in held.items():
            if (first := next((a for a in group if evictable(a)), None)) is not None:
                movable[h] = first
        if not movable:
            break
        holder = max(movable, key=lambda h: (usage[h][measure], usage[h][1 - measure], -movable[h].last_used))
        victim = movable[holder]
        held[holder] = [a for a in held[holder] if a is not victim]  # by identity: entries hold arrays
        usage[holder][0] -= 1
        usage[holder][1] -= size(victim)
        count, nbytes = count - 1, nbytes - size(victim)
        victims.append(victim)
    return victims


__all__ = ["over_cap"]
