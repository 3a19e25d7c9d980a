"""A sparkline on a fixed scale: one column per value, newest at the right.

Why not Textual's own: it scales every series from its minimum to its maximum, so a hit ratio
between 80 % and 100 % fills the box as if it went from nothing to everything, a single value
draws full bars (a 0 % hit ratio looked like 100 %), and points are stretched across the width.
Here a value is drawn against 0 and a ceiling (1.0 for a share, the largest value shown
otherwise), 0 is the lowest mark, and ``None`` (nothing happened then) is a blank column.
"""

from __future__ import annotations

from typing import Callable, Sequence

from rich.color import Color
from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from textual.renderables._blend_colors import blend_colors
from textual.widgets import Sparkline

BARS = "▁▂▃▄▅▆▇█"
Series = Callable[[int], Sequence[float | None]]  # columns -> at most that many values, oldest first


class Bars:
    """The rich renderable: ``values`` right-aligned in ``width`` columns, ``height`` lines tall."""

    def __init__(self, values: Sequence[float | None], width: int, height: int, ceiling: float | None,
                 low: Color, high: Color) -> None:
        self.values = list(values)[-width:] if width > 0 else []
        self.width, self.height = max(0, width), max(1, height)
        shown = [v for v in self.values if v is not None]
        self.ceiling = ceiling if ceiling is not None else max(shown, default=0.0)
        self.low, self.high = low, high

    def level(self, value: float) -> tuple[int, float]:
        """(eighths of a cell filled, 1..8*height; the share of the ceiling)."""
        share = min(1.0, max(0.0, value / self.ceiling)) if self.ceiling > 0 else 0.0
        return max(1, round(share * 8 * self.height)), share

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        columns: list[float | None] = [None] * (self.width - len(self.values)) + self.values
        levels = [None if v is None else self.level(v) for v in columns]
        for line in reversed(range(self.height)):
            for cell in levels:
                if cell is None or cell[0] <= line * 8:
                    yield Segment(" ")
                    continue
                fill, share = cell
                glyph = "█" if fill >= (line + 1) * 8 else BARS[fill - line * 8 - 1]
                yield Segment(glyph, Style(color=blend_colors(self.low, self.high, share)))
            if line:
                yield Segment.line()


class ScaledSparkline(Sparkline):
    """Draws ``series(width)`` at the widget's width; ``ceiling`` None scales to the largest value."""

    def __init__(self, *, ceiling: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ceiling = ceiling
        self.series: Series = lambda columns: []

    def show(self, series: Series) -> None:
        self.series = series
        self.refresh()

    def render(self) -> Bars:
        _, base = self.background_colors
        low = (base + self.get_component_styles("sparkline--min-color").color).rich_color
        high = (base + self.get_component_styles("sparkline--max-color").color).rich_color
        width = self.size.width
        return Bars(self.series(width) if width > 0 else [], width, self.size.height, self.ceiling, low, high)
