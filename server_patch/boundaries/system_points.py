"""Restore points inside a long system message, where its text is structured.

Most templates other than GLM's (Qwen3/3.5, Llama, Mistral, gpt-oss) render the system text
*before* the tools block, so a system prompt that differs near its end (a date, a working
directory, a git status line: the commonest variant in agent traffic) diverges before the tools
and everything after them. Paragraph breaks (``candidates.paragraph_breaks``) cover a system
text written in paragraphs; this adds the finer structure agent prompts use:

* ``heading``: a markdown heading line (``# Rules``);
* ``section``: a line that opens an XML-like section (``<env>``; a closing tag is a ``line``);
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
from server_patch.boundaries.text import SYSTEM_ROLES, leading_system_count, role_of

#: The finer kinds ``thin`` chooses among (paragraph breaks and ``system_text`` are kept as found).
FINE = frozenset({Kind.HEADING, Kind.SECTION, Kind.LINE})
POINT_GAP = 256  # tokens: the policy's default segment_min_gap (closer points are never captured)
MIN_CHARS_APART = 256  # characters between two line points noted in one system message
MIN_SYSTEM_CHARS = 64  # a system text shorter than this is not searched
SEPARATOR_CHARS = 16  # a verified boundary this close after the text's end makes system_text moot
ANCHOR_WINDOW_CHARS = 4 * POINT_GAP  # about POINT_GAP tokens of English text
USER_BLOCKS = 2  # section or heading starts kept in the first user message, from its end

_HEADING = re.compile(r"#{1,6}\s")
_SECTION = re.compile(r"\s*<[A-Za-z][\w:.-]*(\s[^<>]*)?>")  # an opening tag: a section starts


def line_kind(line: str) -> str:
    """The kind of a line start: heading, section or plain line."""
    if _HEADING.match(line):
        return Kind.HEADING
    if _SECTION.match(line):
        return Kind.SECTION
    return Kind.LINE


def structured_breaks(content: str) -> dict[int, str]:
    """Line starts of ``content`` (offsets into it) and their kinds: every heading and section
    start, plain lines at most one per ``MIN_CHARS_APART`` characters from the end back.

    The first line and lines after a paragraph break are left out (the text's start is a
    ``content`` boundary, paragraph breaks ``paragraph`` ones); so is a start with nothing after it."""
    found: dict[int, str] = {}
    last = len(content) + MIN_CHARS_APART
    j = content.rfind("\n")
    while j >= 0:
        start = j + 1
        after_blank = j > 0 and content[j - 1] == "\n"
        if start < len(content) and content[start] != "\n" and not after_blank:
            stop = content.find("\n", start)
            kind = line_kind(content[start:stop if stop >= 0 else len(content)])
            if kind != Kind.LINE or last - start >= MIN_CHARS_APART:  # headings, sections: all of them
                found[start] = kind
                last = start
        j = content.rfind("\n", 0, j)
    return found


def _tail_point(breaks: Mapping[int, str]) -> int:
    """The anchor's candidate among a system text's breaks: the latest section or heading start
    within ``ANCHOR_WINDOW_CHARS`` before its last line start, else that line start."""
    last = max(breaks)
    structural = [b for b, k in breaks.items() if k != Kind.LINE and last - b < ANCHOR_WINDOW_CHARS]
    return max(structural) if structural else last


def add_points(messages: list[Any], full: str, offsets: dict[int, str], keep: int,
               anchor_offsets: list[int]) -> list[int]:
    """Add the structured points of every long system message of ``messages``, and of the first
    user message after them, to ``offsets`` (character offsets into the rendered prompt
    ``full``; existing kinds win). The first user message is where agents put their context
    and reminder blocks (qwen-code's date reminder), which a client that resumes a session
    rebuilds without (issue 37). The last line start of the last leading system message becomes
    an anchor candidate (when there is an anchor): a trailing line shorter than the anchor tail
    (a date, a git status) then stays out of the anchor, so every variant of it restores at its
    start. Returns the anchor candidates."""
    if keep == 0:
        return anchor_offsets
    n_system = leading_system_count(messages)
    first_user = n_system if n_system < len(messages) and role_of(messages[n_system]) == "user" else -1
    search = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        system = role_of(message) in SYSTEM_ROLES
        if not (system or i == first_user) or not isinstance(content, str) or len(content) < MIN_SYSTEM_CHARS:
            continue
        at = full.find(content, search)
        if at < 0:
            continue
        end = search = at + len(content)
        if system and end < len(full) and not any(end <= o < end + SEPARATOR_CHARS for o in offsets):
            offsets.setdefault(end, Kind.SYSTEM_TEXT)
        breaks = structured_breaks(content)
        if not system:  # its last few section and heading starts, as blocks (never thinned as lines)
            blocks = sorted(rel for rel, kind in breaks.items() if kind != Kind.LINE)[-USER_BLOCKS:]
            breaks = {}
            for rel in blocks:
                offsets.setdefault(at + rel, Kind.BLOCK)
        for rel, kind in breaks.items():
            offsets.setdefault(at + rel, kind)
        if i == n_system - 1 and anchor_offsets and breaks:
            anchor_offsets = sorted({*anchor_offsets, at + _tail_point(breaks)})
    return anchor_offsets


def thin(kinds: Mapping[int, str], keep: int, gap: int = POINT_GAP) -> dict[int, str]:
    """``kinds`` (token position -> kind) with the finer system points thinned, ``keep`` at most
    (-1: no limit), each ``gap`` tokens from every other boundary and from each other.

    From the end back, one point per ``gap`` window: the latest heading or section start in the
    window that ends at the latest point left, else that latest point. So a late change restores
    at the start of its own section (a date and a git status line in one ``<env>`` block both
    restore at ``<env>``), or of its own line where the text has no sections. A ``system_text``
    end is not another boundary here: the policy takes the earlier of it and a point before it."""
    others = [p for p, k in kinds.items() if k not in FINE and k != Kind.SYSTEM_TEXT]
    fine = [p for p in sorted((p for p, k in kinds.items() if k in FINE), reverse=True)
            if all(abs(p - q) >= gap for q in others)]
    kept: list[int] = []
    while fine and (keep < 0 or len(kept) < keep):
        window = [p for p in fine if fine[0] - p < gap]
        structural = [p for p in window if kinds[p] != Kind.LINE]
        pick = max(structural) if structural else fine[0]
        kept.append(pick)
        fine = [p for p in fine if p <= pick - gap]
    chosen = set(kept)
    return {p: k for p, k in kinds.items() if k not in FINE or p in chosen}


__all__ = ["FINE", "POINT_GAP", "add_points", "line_kind", "structured_breaks", "thin"]
