"""Aligned lines for a table that arrives row by row (``requests --follow``, ``tail -f`` style).

A fixed format string wastes what the widest value ever could take (a 150-column line that
wraps where the same rows as a table fit 120): here each column is as wide as its header and
the widest value seen so far. The header is printed with the first row (so its widths already
fit that row); a later, wider value widens its column from that row on.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


class FollowLines:
    """Lines of ``columns``; ``numeric`` ones right-aligned, as ``render.table`` aligns them."""

    def __init__(self, columns: Sequence[str], numeric: Sequence[str] = (), least: Mapping[str, int] | None = None) -> None:
        """``least``: widths a column's values commonly take (so the header lines up with them)."""
        self.columns = list(columns)
        self.right = [name in numeric for name in columns]
        self.widths = [max(len(name), (least or {}).get(name, 0)) for name in columns]
        self.started = False

    def lines(self, cells: Sequence[Any]) -> list[str]:
        """The line for one row, preceded by the header line before the first row."""
        texts = [str(cell) for cell in cells]
        self.widths = [max(width, len(text)) for width, text in zip(self.widths, texts)]
        out = [] if self.started else [self._line(self.columns)]
        self.started = True
        return [*out, self._line(texts)]

    def _line(self, texts: Sequence[str]) -> str:
        last = len(texts) - 1
        return "  ".join(text if n == last and not right else text.rjust(width) if right else text.ljust(width)
                         for n, (text, width, right) in enumerate(zip(texts, self.widths, self.right)))


__all__ = ["FollowLines"]
