"""A labelled bar of used against limit, for the cache budgets and the buffer pool."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from apcctl.core import render

BAR = "━"
MIN_BAR = 4


def gauge_text(label: str, used: float | None, limit: float | None, width: int, *, detail: str = "",
               unit: str = "bytes") -> Text:
    """``label ━━━━━━──── used / limit``: green, yellow past 75 %, red past 90 %."""
    fmt = render.human_bytes if unit == "bytes" else (lambda n: "-" if n is None else f"{int(n):,}")
    numbers = f"{fmt(used)} / {fmt(limit)}" if limit else fmt(used)
    if detail and len(label) + len(numbers) + len(detail) + 2 + MIN_BAR + 3 <= width:
        numbers += f"  {detail}"  # the detail only where it leaves the bar room
    if len(label) + len(numbers) + MIN_BAR + 3 > width:
        label = label.rstrip()  # narrow: the label's alignment padding goes before the numbers do
    if len(label) + len(numbers) + MIN_BAR + 3 > width:  # narrower still: the label is cut, never a unit
        label = label[:max(1, width - len(numbers) - MIN_BAR - 3)]
    bar_width = max(MIN_BAR, width - len(label) - len(numbers) - 3)
    share = min(1.0, (used or 0) / limit) if limit else 0.0
    filled = round(share * bar_width)
    colour = "red" if share > 0.9 else "yellow" if share > 0.75 else "green"
    text = Text(f"{label} ", style="bold")
    text.append(BAR * filled, style=colour)
    text.append(BAR * (bar_width - filled), style="grey30")
    text.append(f" {numbers}")
    return text


class Gauge(Static):
    """One budget line; ``set`` redraws it at the widget's current width."""

    DEFAULT_CSS = "Gauge { height: 1; }"

    def __init__(self, label: str, *, unit: str = "bytes", **kwargs) -> None:
        super().__init__(**kwargs)
        self.label = label
        self.unit = unit
        self.values: tuple[float | None, float | None, str] = (None, None, "")

    def set(self, used: float | None, limit: float | None, detail: str = "") -> None:
        self.values = (used, limit, detail)
        self.refresh()

    def render(self) -> Text:
        used, limit, detail = self.values
        return gauge_text(self.label, used, limit, self.size.width or 40, detail=detail, unit=self.unit)
