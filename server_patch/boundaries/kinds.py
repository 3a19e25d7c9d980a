"""What ends at a boundary, and the BPE slack a plain-text seam is moved back by."""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    """The kind of a boundary: what ends there (the values are what the admin and traces show)."""

    TOOLS = "tools"  # the tools block, or whatever the template renders before the first message
    TOOL = "tool"  # one tool inside the tools block (opt-in)
    CONTENT = "content"  # the header of the first message (its content starts here)
    SYSTEM = "system"  # a system/developer message
    PARAGRAPH = "paragraph"  # a paragraph break ("\n\n") inside a system message
    SYSTEM_TEXT = "system_text"  # a system message's text ends; the template's own text follows
    HEADING = "heading"  # a markdown heading line starts inside a system message
    SECTION = "section"  # an XML-like section line (<env>, </rules>) starts inside a system message
    LINE = "line"  # any other line starts inside a system message
    BLOCK = "block"  # a section or heading starts inside the first user message (a reminder block)
    MESSAGE = "message"  # any other message: the next one starts here
    STRIDE = "stride"  # fallback: a multiple of the periodic stride
    # A conversation an earlier request sent whole ends here (the next message starts): no
    # restore point (that request's entry is a few tokens on, past its generation prompt), so
    # it is not among the segments; the drift finder counts it to number the messages.
    SENT = "sent"
    # A prefix render that draws its last message otherwise than the whole prompt does (Qwen3
    # adds empty ``<think>`` tags to the last assistant turn) parts from the prompt here, inside
    # that message: a restore point (prompts sharing it part there), not a message's end.
    PARTING = "parting"
    # Labels, never restore points (the policy's captures are as without them; the drift
    # finder names segments by them), each where a plain seam would be exact (an added token
    # next to it):
    REJOIN = "rejoin"  # that message's real end: where the render's tail rejoins the prompt
    BEFORE_TOOLS = "before_tools"  # a tools block rendered inside the first message starts here
    TOOLS_END = "tools_end"  # ... and ends here (Qwen3: before the system turn's end token)


#: Kinds that name a position for the drift finder only: not among the policy's segments.
LABELS = frozenset({Kind.SENT, Kind.REJOIN, Kind.BEFORE_TOOLS, Kind.TOOLS_END})


# Which kind names a position found twice (lower wins).
RANK: dict[str, int] = {Kind.SYSTEM: 0, Kind.TOOLS: 1, Kind.MESSAGE: 2, Kind.CONTENT: 3, Kind.PARAGRAPH: 4,
                        Kind.TOOL: 5, Kind.SYSTEM_TEXT: 6, Kind.HEADING: 7, Kind.SECTION: 7, Kind.BLOCK: 7,
                        Kind.LINE: 8, Kind.PARTING: 8}
UNRANKED = 9

# Tokens a plain-text seam is moved earlier: BPE may merge across it, and a checkpoint must stay
# valid for a prompt whose text after the seam differs. A seam next to an added token is exact.
BPE_SLACK = 2


def outranks(kind: str, other: str) -> bool:
    """Whether ``kind`` names a position in place of ``other``."""
    return RANK.get(kind, UNRANKED) < RANK.get(other, UNRANKED)
