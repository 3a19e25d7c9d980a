"""One lineage entry's checkpoints on a horizontal axis of token positions.

Why a picture: a restore can only start at a checkpoint (or the entry's end), so where they
sit along the conversation tells an operator what a resend, an edit or a branch will reuse.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text
from textual.widget import Widget

from apcctl.core import render

MARKS = {  # checkpoint kind -> (glyph, style)
    "final": ("◆", "bold green"),
    "divergence": ("▲", "bold magenta"),
    "periodic": ("■", "bold blue"),
    "segment": ("●", "bold cyan"),
    "guard": ("◇", "bold yellow"),
}
HEAD = ("▶", "bold white")


def column_of(position: int, length: int, width: int) -> int:
    """Where token ``position`` of ``length`` falls on an axis ``width`` cells wide."""
    if length <= 0 or width <= 1:
        return 0
    return min(width - 1, max(0, round(position / length * (width - 1))))


def axis(entry: dict[str, Any], width: int) -> tuple[Text, Text]:
    """The axis line with a mark per checkpoint, and a line of their token positions under it."""
    length = int(entry.get("length") or 0)
    left, right = "0 ", f" {length:,}"
    inner = max(8, width - len(left) - len(right) - 2)
    cells: list[tuple[str, str]] = [("─", "grey42")] * inner
    points = sorted(entry.get("checkpoints") or [], key=lambda c: c["length"])
    for point in points:
        cells[column_of(point["length"], length, inner)] = MARKS.get(point["kind"], ("?", "bold red"))
    cells[inner - 1] = HEAD
    line = Text(left, style="grey62")
    line.append("├", style="grey42")
    for glyph, style in cells:
        line.append(glyph, style=style)
    line.append("┤", style="grey42")
    line.append(right, style="grey62")
    labels = [" "] * (inner + len(left) + 2)
    taken_until = -1
    for point in points:
        label = f"{point['length']:,}"
        start = len(left) + 1 + column_of(point["length"], length, inner) - len(label) // 2
        start = max(start, taken_until + 1)
        if start + len(label) <= len(labels):
            labels[start:start + len(label)] = label
            taken_until = start + len(label)
    return line, Text("".join(labels).rstrip(), style="grey62")


def legend() -> Text:
    text = Text()
    for kind, (glyph, style) in [*MARKS.items(), ("entry end", HEAD)]:
        text.append(glyph, style=style)
        text.append(f" {kind}   ", style="grey62")
    return text


def checkpoint_table(entry: dict[str, Any], now: float) -> render.Fitted:
    table = render.table(("AT TOKEN", "KIND", "SIZE", "HITS", "LAST HIT", "CREATED"),
                         [], numeric=("AT TOKEN", "SIZE", "HITS"))
    for point in sorted(entry.get("checkpoints") or [], key=lambda c: c["length"]):
        glyph, style = MARKS.get(point["kind"], ("?", "bold red"))
        table.add_row(f"{point['length']:,}", Text.assemble((glyph, style), f" {point['kind']}"),
                      render.human_bytes(point.get("bytes")), str(point.get("hits", 0)),
                      render.ago(point.get("last_hit"), now), render.ago(point.get("created"), now))
    return table


def describe(entry: dict[str, Any]) -> Text:
    count = len(entry.get("checkpoints") or [])
    title = Text(f"{entry['id']}", style="bold")
    title.append(f"  {entry.get('kind', '?')}{' (pinned)' if entry.get('pinned') else ''} · "
                 f"{int(entry.get('length') or 0):,} tokens · KV {render.human_bytes(entry.get('kv_bytes'))} · "
                 f"checkpoints {count} ({render.human_bytes(entry.get('checkpoint_bytes'))}) · {entry.get('tier')}",
                 style="grey70")
    if entry.get("label"):
        title.append(f"\n{render.printable(entry['label'])}", style="italic grey62")
    return title


class CheckpointTimeline(Widget):
    """Shows the entry handed to ``show``; drawn at the widget's width on every resize."""

    DEFAULT_CSS = "CheckpointTimeline { height: auto; padding: 0 1; }"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.entry: dict[str, Any] | None = None
        self.now = 0.0

    def show(self, entry: dict[str, Any] | None, now: float) -> None:
        self.entry, self.now = entry, now
        self.refresh(layout=True)

    def render(self) -> RenderableType:
        if self.entry is None:
            return Text("Select an entry to see its checkpoints along the conversation.", style="grey62")
        line, labels = axis(self.entry, max(20, self.size.width - 2))
        parts: list[RenderableType] = [describe(self.entry), line, labels, legend()]
        if self.entry.get("checkpoints"):
            parts.append(checkpoint_table(self.entry, self.now))
        else:
            parts.append(Text("No checkpoints: a restore can only start at the entry's end.", style="grey62"))
        return Group(*parts)
