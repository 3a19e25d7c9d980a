"""The data that travels through boundary finding: renders, candidates, notes, walks, results."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

import numpy as np


@dataclass(frozen=True)
class Point:
    """One prefix render as the render cache keeps it (not its text: a later prompt verifies it).

    ``length``/``digest``: the render's length and the digest of its text; ``cut``/``cut_digest``:
    where it leaves the prompt's text (``cut == length`` when it is a prefix of it).
    """

    length: int
    digest: bytes
    cut: int
    cut_digest: bytes
    # Where the render's last message really ends in the prompt's text, when the render parts
    # from it inside that message (-1: a prefix, or not found): ``finder.rejoin``.
    rejoin: int = -1
    rejoin_digest: bytes = b""

    @property
    def is_prefix(self) -> bool:
        return self.cut == self.length


@dataclass(frozen=True)
class ToolCuts:
    """The end of each tool inside the tools block: (character offset, digest of the text before)."""

    cuts: tuple[tuple[int, bytes], ...] = ()


@dataclass(frozen=True)
class Labels:
    """Label boundaries (``kinds.LABELS``) found from renders: (character offset, kind, digest
    of the text before)."""

    points: tuple[tuple[int, str, bytes], ...] = ()


Rendered = Union[Point, ToolCuts, Labels, None]  # what the render cache holds (None: the render failed)


@dataclass
class RenderBudget:
    """How many renders one request may still add to the cache."""

    left: int

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


@dataclass(frozen=True)
class Request:
    """One chat request being noted: how to render its prefixes, where two renders part, its
    full rendered text, the cache-key seed of its template arguments, and its render budget."""

    render: Callable[..., str]
    parting: Callable[[str, str], int]
    full: str
    base: bytes
    budget: RenderBudget
    whole: Point | None = None  # the render of all its messages (its text less the generation prompt)
    exact: Callable[[str, int], bool] = lambda text, offset: False  # an added token next to the offset
    added: tuple[str, ...] = ()  # the tokenizer's added tokens' texts


@dataclass
class Candidate:
    """A boundary in the rendered text: its character offset and the digest of the text before it."""

    offset: int
    kind: str
    digest: bytes
    # A whole prefix render that lies before the end of the last message: one of these must
    # verify for the template to count as renderable piecewise (the render of all messages
    # is a prefix of almost any template's output, and a common prefix alone proves nothing).
    witness: bool = False


@dataclass
class Note:
    """One rendered request: its text split at verified boundaries, each piece tokenized."""

    pieces: list[np.ndarray]
    kinds: list[str]  # kinds[j]: the boundary at the end of piece j (len(pieces) - 1 of them)
    anchor_seams: tuple[int, ...]  # seams ending each leading system message (or the tools alone)
    label: str
    hard_ids: frozenset[int]
    key: int = 0

    @property
    def length(self) -> int:
        return sum(int(p.shape[0]) for p in self.pieces)


@dataclass
class Walk:
    """How far a note matched a prompt: boundary positions (slack applied) and tokens covered."""

    note: Note
    positions: list[tuple[int, str]]
    covered: int
    anchors: list[int]  # token positions of the leading system message ends the walk reached


@dataclass(frozen=True)
class SegmentInfo:
    """Where this prompt's template segments end, as token lengths.

    ``anchor_len``/``anchor_label``: the system+tools prefix, ``segments``: every boundary,
    sorted; ``kinds``: the kind of each; ``source``: "template" (from a noted render),
    "fallback" (stride) or "none".
    """

    anchor_len: int | None
    anchor_label: str
    segments: list[int]
    source: str = "none"
    kinds: Mapping[int, str] = field(default_factory=dict)


class RenderCache:
    """Prefix renders by their hash-chain key, least recently used dropped first. Thread-safe."""

    def __init__(self, entries: int, stats: Counter[str]) -> None:
        self.entries = entries
        self.stats = stats
        self._lock = threading.Lock()
        self._renders: OrderedDict[bytes, Rendered] = OrderedDict()

    def get(self, key: bytes, make: Callable[[], Rendered], budget: RenderBudget,
            on_failure: Callable[[Exception], None]) -> Rendered:
        """The cached render for ``key``, else ``make()`` while the budget lasts (a failure is kept
        as None: a template that cannot render this prefix gives no boundary here)."""
        with self._lock:
            if key in self._renders:
                self._renders.move_to_end(key)
                self.stats["render_hits"] += 1
                return self._renders[key]
        if not budget.take():
            self.stats["render_skipped"] += 1
            return None
        try:
            value = make()
        except Exception as exc:
            on_failure(exc)
            value = None
            self.stats["render_failures"] += 1
        with self._lock:
            self._renders[key] = value
            while len(self._renders) > self.entries:
                self._renders.popitem(last=False)
        return value


class RecentKeys:
    """A bounded map of recent keys (the message chains earlier requests sent whole) to where
    each one's render ends (None: unknown). Thread-safe."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._lock = threading.Lock()
        self._keys: OrderedDict[bytes, Point | None] = OrderedDict()

    def seen_then_add(self, keys: list[bytes], new: bytes, end: Point | None = None) -> dict[int, Point | None]:
        """Indices ``i`` (1 ..) whose ``keys[i - 1]`` was added before, with the end added for
        it; then add ``new`` (a known ``end`` is kept over an unknown one)."""
        with self._lock:
            seen = {i: self._keys[keys[i - 1]] for i in range(1, len(keys)) if keys[i - 1] in self._keys}
            self._keys[new] = end if end is not None else self._keys.get(new)
            self._keys.move_to_end(new)
            while len(self._keys) > self.entries:
                self._keys.popitem(last=False)
        return seen
