"""The two header lines: which server, is it up, what it costs the machine, and the dashboard's mode."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from rich.text import Text
from textual.widgets import Static

from apcctl.core import render
from tui.state import DashboardState


@dataclass(frozen=True)
class Mode:
    """The dashboard's own switches, shown beside the server's state."""

    paused: bool = False
    read_only: bool = False
    refresh_s: float = 1.0


def connection_text(state: DashboardState) -> Text:
    conn = state.connection
    if conn.state == "live" and conn.stream == "live":
        return Text("● live", style="bold green")
    if conn.state == "live":
        return Text("● live, events reconnecting", style="bold yellow")
    if conn.state == "connecting":
        suffix = f": {conn.error}" if conn.error else ""
        return Text(f"◌ connecting{suffix}", style="bold yellow")
    return Text(f"✕ lost ({conn.failures} tries): {conn.error}", style="bold red")


def fit(parts: list[tuple[int, Text]], width: int | None, sep: Text) -> Text:
    """The parts that fit in ``width``, most important (lowest rank) first, drawn in their own order."""
    kept: set[int] = set()
    used = 0
    for index, (_, part) in sorted(enumerate(parts), key=lambda item: item[1][0]):
        extra = part.cell_len + (sep.cell_len if kept else 0)
        if width is None or used + extra <= width or not kept:
            kept.add(index)
            used += extra
    line = Text(no_wrap=True, overflow="ellipsis")
    for index, (_, part) in enumerate(parts):
        if index in kept:
            if line:
                line.append_text(sep)
            line.append_text(part)
    return line


def _fact(name: str, value: str, style: str = "bold") -> Text:
    return Text.assemble((f"{name} ", "grey62"), (value, style))


def header_text(state: DashboardState, source_name: str, mode: Mode, width: int | None = None) -> Text:
    """Two lines; at ``width`` the least useful facts (versions, CPU, RSS, uptime) go first."""
    status = state.status
    server, idle = (status.server, status.idle) if status is not None else (None, None)
    dot = Text(" · ", style="grey50")
    model = server.model if server else None
    local = state.process is not None
    first: list[tuple[int, Text]] = [
        (0, Text.assemble(connection_text(state), "  ", (source_name, "bold"))),
        (1, _fact("model", PurePath(model).name if model else "-")),
        (3, _fact("pid", str(server.pid if server else "-"))),
        (2, _fact("up", render.human_duration(server.uptime_s if server else None))),
        (4, _fact("RSS", render.human_bytes(state.process.rss_bytes) if local else "remote")),
        (5, _fact("CPU", f"{state.process.cpu_percent:.0f}%" if local else "remote")),
    ]
    second: list[tuple[int, Text]] = [
        (6, _fact("mlx-vlm", (server.mlx_vlm_version if server else None) or "-", "")),
        (7, _fact("patch", (server.patch_version if server else None) or "-", "")),
        (1, _fact("in flight", str(idle.in_flight if idle else "-"), "")),
        (2, _fact("queued", str(idle.queued if idle else "-"), "")),
        (3, _fact("refresh", f"{mode.refresh_s:g}s", "")),
        (4, _fact("restarts seen", str(state.restarts_seen), "")),
    ]
    suspects = status.canary.suspects if status is not None and status.canary else []
    badges = Text()
    for flag, on, style in ((f"SUSPECT: {', '.join(suspects)}", bool(suspects), "white on red"),
                            ("DRAINING", idle is not None and idle.draining, "black on yellow"),
                            ("PAUSED", mode.paused, "black on cyan"),
                            ("READ-ONLY", mode.read_only, "black on magenta")):
        if on:
            badges.append("  ")
            badges.append(f" {flag} ", style=style)
    room = None if width is None else max(0, width - badges.cell_len)
    line_two = fit(second, room, dot)
    line_two.append_text(badges)  # the badges always show
    return Text("\n").join([fit(first, width, dot), line_two])


class ServerHeader(Static):
    """Redrawn on every poll, every mode change and every resize, at the widget's width."""

    DEFAULT_CSS = "ServerHeader { height: 2; padding: 0 1; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shown: tuple[DashboardState, str, Mode] | None = None

    def show(self, state: DashboardState, source_name: str, mode: Mode) -> None:
        self.shown = (state, source_name, mode)
        self.refresh()

    def render(self) -> Text:
        if self.shown is None:
            return Text("")
        return header_text(*self.shown, width=self.content_size.width or None)
