"""The two header lines: which server, is it up, what it costs the machine, and the dashboard's mode."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from rich.text import Text
from textual.widgets import Static

from apcctl import render
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


def header_text(state: DashboardState, source_name: str, mode: Mode) -> Text:
    server = (state.status or {}).get("server") or {}
    idle = (state.status or {}).get("idle") or {}
    dot = Text(" · ", style="grey50")
    first = Text.assemble(connection_text(state), "  ", (source_name, "bold"))
    model = server.get("model")
    facts = [
        ("model", PurePath(model).name if model else "-"),
        ("pid", str(server.get("pid", "-"))),
        ("up", render.human_duration(server.get("uptime_s"))),
    ]
    if state.process is not None:
        facts += [("RSS", render.human_bytes(state.process.rss_bytes)), ("CPU", f"{state.process.cpu_percent:.0f}%")]
    else:
        facts += [("RSS", "remote"), ("CPU", "remote")]
    for name, value in facts:
        first.append_text(dot)
        first.append(f"{name} ", style="grey62")
        first.append(value, style="bold")
    second = Text()
    for name, value in (("mlx-vlm", server.get("mlx_vlm_version", "-")), ("patch", server.get("patch_version", "-")),
                        ("in flight", str(idle.get("in_flight", "-"))), ("queued", str(idle.get("queued", "-"))),
                        ("refresh", f"{mode.refresh_s:g}s"), ("restarts seen", str(state.restarts_seen))):
        if second:
            second.append_text(dot)
        second.append(f"{name} ", style="grey62")
        second.append(value)
    for flag, on, style in (("DRAINING", idle.get("draining"), "black on yellow"),
                            ("PAUSED", mode.paused, "black on cyan"),
                            ("READ-ONLY", mode.read_only, "black on magenta")):
        if on:
            second.append("  ")
            second.append(f" {flag} ", style=style)
    return Text("\n").join([first, second])


class ServerHeader(Static):
    """Redrawn on every poll and every mode change."""

    DEFAULT_CSS = "ServerHeader { height: 2; padding: 0 1; }"

    def show(self, state: DashboardState, source_name: str, mode: Mode) -> None:
        self.update(header_text(state, source_name, mode))
