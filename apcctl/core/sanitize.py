"""Text from a server or a client, made safe for a terminal: no escape sequence, no control
character. Light (``re`` only), so the admin client's errors and the CLI's messages use it
without loading rich; ``render.printable`` is this module's ``printable``."""

from __future__ import annotations

import re
from typing import Any

# Terminal escape sequences whole (CSI ``ESC [ ... final``; OSC, DCS, PM, APC and SOS strings up to
# their terminator, or to the end when there is none), in 7- and 8-bit form; then any C0, DEL or
# C1 control left, and the bidirectional overrides that reorder what a terminal shows.
_ESCAPES = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
                      r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|$)"
                      r"|\x1b[ -~]?", re.DOTALL)
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_LINE_BREAKS = re.compile(r"[\t\n\r\x0b\x0c\x85\u2028\u2029]+")  # one row stays one line: a space
_LINES = re.compile(r"\r\n|[\n\r\x0b\x0c\x85\u2028\u2029]")


def printable(value: Any) -> str:
    """``value`` as text a terminal shows as it is: escape sequences and control characters removed.

    Labels come from clients (an anchor's label is the start of a system prompt): printed raw, an
    ``ESC[2J`` would clear the screen and an OSC string retitle the window. Every table cell and
    every client-derived string the CLI and the dashboard print goes through here.
    """
    return _CONTROLS.sub("", _LINE_BREAKS.sub(" ", _ESCAPES.sub("", str(value))))


def printable_lines(value: Any) -> str:
    """``printable`` line by line: a log or a multi-line message keeps its lines (``\\n``), and an
    escape sequence never spans two of them (each line is cleaned on its own)."""
    return "\n".join(printable(line) for line in _LINES.split(str(value)))
