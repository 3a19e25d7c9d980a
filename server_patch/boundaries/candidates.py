"""From renders to verified boundaries in the rendered text (character offsets and kinds)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from server_patch.boundaries.kinds import Kind, outranks
from server_patch.boundaries.notes import Candidate, Point
from server_patch.boundaries.text import SYSTEM_ROLES, leading_system_count, role_of

MIN_PARAGRAPH_SEARCH = 64  # a system text shorter than this is not searched for paragraphs


@dataclass
class Candidates:
    """Candidate boundaries of one request, to verify against its full text."""

    items: list[Candidate] = field(default_factory=list)

    def add_point(self, point: Point | None, kind: str, witness: bool = True, cut_kind: str | None = None) -> None:
        """A prefix render's end, and where it leaves the prompt's text when it is not a prefix
        (``cut_kind``, else ``kind``)."""
        if point is None:
            return
        if point.length > 0:
            self.items.append(Candidate(point.length, kind, point.digest, witness))
        if 0 < point.cut < point.length:
            self.items.append(Candidate(point.cut, cut_kind or kind, point.cut_digest))

    def add(self, offset: int, kind: str, digest: bytes, witness: bool = False) -> None:
        self.items.append(Candidate(offset, kind, digest, witness))


def verify(candidates: list[Candidate], full: str) -> dict[int, str] | None:
    """Offsets whose text prefix equals the prompt's (one incremental hash over the prompt);
    None when no witness verified: the template does not render piecewise."""
    good: dict[int, str] = {}
    h = hashlib.blake2b(digest_size=16)
    position, piecewise = 0, False
    for cand in sorted(candidates, key=lambda c: c.offset):
        if not 0 < cand.offset < len(full):
            continue
        h.update(full[position:cand.offset].encode("utf-8", "surrogatepass"))
        position = cand.offset
        if h.copy().digest() != cand.digest:
            continue
        piecewise = piecewise or cand.witness
        old = good.get(cand.offset)
        if old is None or outranks(cand.kind, old):
            good[cand.offset] = cand.kind
    return good if piecewise else None


def paragraph_breaks(messages: list[Any], full: str, offsets: dict[int, str], anchor_offsets: list[int],
                     keep: int) -> list[int]:
    """Add the last ``keep`` paragraph breaks of each system message to ``offsets`` (found
    verbatim in the prompt text, so no render is needed); those of the last leading system
    message become anchor candidates too (the anchor may end before a short trailing paragraph).
    Returns the anchor candidates."""
    n_system = leading_system_count(messages)
    search = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if role_of(message) not in SYSTEM_ROLES or not isinstance(content, str) \
                or len(content) < MIN_PARAGRAPH_SEARCH or "\n\n" not in content:
            continue
        at = full.find(content, search)
        if at < 0:
            continue
        search = at + len(content)
        breaks = [at + start for start in _paragraph_starts(content)]
        if keep > 0:
            breaks = breaks[-keep:]
        for b in breaks:
            offsets.setdefault(b, Kind.PARAGRAPH)
        if i == n_system - 1 and anchor_offsets:
            anchor_offsets = sorted(set(anchor_offsets) | set(breaks))
    return anchor_offsets


def _paragraph_starts(content: str) -> list[int]:
    """Where each paragraph after the first starts (past a run of newlines of two or more)."""
    starts, j = [], content.find("\n\n")
    while j >= 0:
        stop = j + 2
        while stop < len(content) and content[stop] == "\n":
            stop += 1
        if 0 < j and stop < len(content):
            starts.append(stop)
        j = content.find("\n\n", stop)
    return starts
