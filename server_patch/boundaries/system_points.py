"""Restore points inside a long system message, where its text is structured.

Most templates other than GLM's (Qwen3/3.5, Llama, Mistral, gpt-oss) render the system text
*before* the tools block, so a system prompt that differs near its end (a date, a working
directory, a git status line: the commonest variant in agent traffic) diverges before the tools
and everything after them. Paragraph breaks (``candidates.paragraph_breaks``) cover a system
text written in paragraphs; this adds the finer structure agent prompts use:

* ``heading``: a markdown heading line (``# Rules``);
* ``section``: a line that opens or closes an XML-like section (``<env>``, ``</rules>``);
* ``line``: any other line start;
* ``system_text``: where the system text ends and the template's own text resumes (Qwen3's
  ``"\\n\\n# Tools"`` after the system content): the point a sub-agent with the same system
  text and other tools shares.

They are found verbatim in the rendered prompt (no render), at most one per
``MIN_CHARS_APART`` characters from the end of each system message backwards. Which of them
are offered is decided in token space (``thin``): from the end backwards, each at least
``POINT_GAP`` tokens from every other boundary and from the points already kept, at most
``keep`` of them (``APC_SEGMENTS_SYSTEM_PARAGRAPHS``). The last structured point before a late
change is therefore offered, and the policy's own gap rule (the same 256 tokens) does not drop
it for a neighbour. They are candidates only: the policy captures them by its segment rules,
thins them with the rest and accounts their bytes (docs/segments.md).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from server_patch.boundaries.kinds import Kind
from server_patch.boundaries.text import SYSTEM_ROLES, role_of

#: The finer kinds ``thin`` chooses among (paragraph breaks and ``system_text`` are kept as found).
FINE = frozenset({Kind.HEADING, Kind.SECTION, Kind.LINE})
POINT_GAP = 256  # tokens: the policy's default segment_min_gap (closer points are never captured)
MIN_CHARS_APART = 256  # characters between two line points noted in one system message
MIN_SYSTEM_CHARS = 64  # a system text shorter than this is not searched
SEPARATOR_CHARS = 16  # a verified boundary this close after the text's end makes system_text moot

_HEADING = re.compile(r"#{1,6}\s")
_SECTION = re.compile(r"\s*</?[A-Za-z][\w:.-]*(\s[^<>]*)?/?>")


def line_kind(line: str) -> str:
    """The kind of a line start: heading, section or plain line."""
    if _HEADING.match(line):
        return Kind.HEADING
    if _SECTION.match(line):
        return Kind.SECTION
    return Kind.LINE


def structured_breaks(content: str) -> dict[int, str]:
    """Line starts of ``content`` (offsets into it) and their kinds, spaced from the end back.

    The first line and lines after a paragraph break are left out (the text's start is a
    ``content`` boundary, paragraph breaks ``paragraph`` ones); so is a start with nothing after it."""
    found: dict[int, str] = {}
    last = len(content) + MIN_CHARS_APART
    j = content.rfind("\n")
    while j >= 0:
        start = j + 1
        after_blank = j > 0 and content[j - 1] == "\n"
        if start < len(content) and content[start] != "\n" and not after_blank and last - start >= MIN_CHARS_APART:
            line = content[start:content.find("\n", start) if "\n" in content[start:] else len(content)]
            found[start] = line_kind(line)
            last = start
        j = content.rfind("\n", 0, j)
    return found


def add_points(messages: list[Any], full: str, offsets: dict[int, str], keep: int) -> None:
    """Add the structured points of every long system message of ``messages`` to ``offsets``
    (character offsets into the rendered prompt ``full``; existing kinds win)."""
    if keep == 0:
        return
    search = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if role_of(message) not in SYSTEM_ROLES or not isinstance(content, str) or len(content) < MIN_SYSTEM_CHARS:
            continue
        at = full.find(content, search)
        if at < 0:
            continue
        end = search = at + len(content)
        if end < len(full) and not any(end <= o < end + SEPARATOR_CHARS for o in offsets):
            offsets.setdefault(end, Kind.SYSTEM_TEXT)
        for rel, kind in structured_breaks(content).items():
            offsets.setdefault(at + rel, kind)


def thin(kinds: Mapping[int, str], keep: int, gap: int = POINT_GAP) -> dict[int, str]:
    """``kinds`` (token position -> kind) with the finer system points thinned: from the last
    back, each ``gap`` tokens from every other boundary and every point kept, ``keep`` at most
    (-1: no limit)."""
    fine = sorted((p for p, k in kinds.items() if k in FINE), reverse=True)
    if not fine:
        return dict(kinds)
    others = [p for p, k in kinds.items() if k not in FINE]
    kept: list[int] = []
    for p in fine:
        if 0 <= keep <= len(kept):
            break
        if all(abs(p - q) >= gap for q in (*others, *kept)):
            kept.append(p)
    chosen = set(kept)
    return {p: k for p, k in kinds.items() if k not in FINE or p in chosen}


__all__ = ["FINE", "POINT_GAP", "add_points", "line_kind", "structured_breaks", "thin"]
