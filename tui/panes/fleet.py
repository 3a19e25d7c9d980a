"""The Fleet tab (``apcctl top --fleet``): per server the gateway's state of it, in flight, hit
ratio and budgets; below, the newest requests of the whole fleet with the server each went to.

During a rolling restart (the Restart tab, which rolls the fleet's servers through the gateway)
this is where a server is seen leaving the gateway (absent), coming back and turning healthy.

Enter on a server row picks the server the other tabs show (as k9s switches contexts); the
gateway box says which one they show.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from apcctl.core import render
from server_patch.admin.schema import Budgets
from tui.columns import request_columns
from tui.fleet import FleetServer, FleetSnapshot
from tui.messages import ServerRequested
from tui.panes.base import Pane
from tui.state import DashboardState, Keyed
from tui.widgets.keyed_table import Column, KeyedTable

STATE_STYLES = {"healthy": "green", "draining": "yellow", "unhealthy": "red", "absent": "bold red"}
REQUEST_ROWS = 60


def _used(used: Any, limit: Any, human: bool = True) -> str:
    if used is None:
        return "-"
    show = render.human_bytes if human else (lambda n: f"{int(n):,}")
    return f"{show(used)} / {show(limit)}" if limit else show(used)


def _pinned(budgets: dict[str, Any]) -> int | None:
    """Pinned anchors wherever they are (``Budgets.pinned``: in RAM, or only on disk), as ``status`` counts them."""
    return Budgets.from_json(budgets, "budgets").pinned if budgets else None


def server_columns() -> list[Column[FleetServer]]:
    def count(value: Any) -> str:
        return "-" if value is None else str(value)

    return [
        Column("name", "SERVER", lambda s: s.name, lambda s: s.name),
        Column("state", "GATEWAY", lambda s: Text(s.state, style=STATE_STYLES.get(s.state, "")), lambda s: s.state),
        Column("load", "LOAD", lambda s: count(s.load), lambda s: s.load, numeric=True),
        Column("in_flight", "IN FLIGHT", lambda s: count(s.idle.get("in_flight")) if s.status else "-",
               lambda s: s.idle.get("in_flight"), numeric=True),
        Column("requests", "REQUESTS", lambda s: f"{s.hits.requests:,}" if s.status else "-",
               lambda s: s.hits.requests, numeric=True),
        Column("hit_rate", "HIT RATIO", lambda s: render.percent(s.hits.hits, s.hits.requests),
               lambda s: s.hits.hit_rate, numeric=True),
        Column("token_hit_rate", "REUSED", lambda s: render.percent(
            s.hits.reused_tokens, s.hits.reused_tokens + s.hits.prefill_tokens),
            lambda s: s.hits.token_hit_rate, numeric=True),
        Column("ram", "RAM", lambda s: _used(s.budgets.get("ram_used"), s.budgets.get("ram_limit")),
               lambda s: s.budgets.get("ram_used"), numeric=True),
        Column("anchors", "ANCHORS", lambda s: _used(_pinned(s.budgets), s.budgets.get("anchor_count_limit"),
                                                     human=False),
               lambda s: _pinned(s.budgets), numeric=True),
        Column("disk", "DISK", lambda s: _used(s.budgets.get("disk_used"), s.budgets.get("disk_limit")),
               lambda s: s.budgets.get("disk_used"), numeric=True),
        Column("status", "PROCESS", lambda s: _says(s), lambda s: _says(s).plain),
    ]


def _says(server: FleetServer) -> Text:
    """The server's own word, short (the Live tab of that server has the rest)."""
    if server.status is None:
        return Text("unreachable", style="red")
    pid = (server.status.get("server") or {}).get("pid")
    if server.idle.get("draining"):
        return Text(f"pid {pid} draining", style="yellow")
    return Text(f"pid {pid} up")


def fleet_request_columns() -> list[Column[Keyed]]:
    """The Live tab's request columns, with the server each request went to."""
    return [Column("server", "SERVER", lambda r: str(r.data.get("server", "?")), lambda r: r.data.get("server")),
            *request_columns()]


def gateway_line(fleet: FleetSnapshot | None, error: str, shown: str = "") -> Text:
    if fleet is None:
        return Text(f"asking the fleet… {error}".rstrip(), style="red" if error else "grey62")
    text = Text()
    text.append(f"gateway {fleet.gateway}", style="bold")
    text.append(f"  policy {fleet.policy}  ")
    style = "green" if fleet.healthy == len(fleet.servers) else "yellow" if fleet.healthy else "bold red"
    text.append(f"{fleet.healthy} of {len(fleet.servers)} servers healthy in the gateway", style=style)
    if shown:
        text.append(f"\nthe other tabs show {shown} (Enter on a server to show another)", style="bold")
    for server in fleet.servers:
        if server.status is None:
            text.append(f"\n{server.name} does not answer: {server.error}", style="red")
    if fleet.gateway_error:
        text.append(f"\nthe gateway does not answer: {fleet.gateway_error}", style="bold red")
    if error:
        text.append(f"\nlast poll failed: {error}", style="red")
    return text


class FleetPane(Pane):
    shown = ""  # the server the other tabs show (the app sets it)

    def compose(self) -> ComposeResult:
        yield Static(id="fleet-gateway", classes="box")
        yield KeyedTable(server_columns(), lambda s: s.name, title="Servers", id="fleet-servers")
        yield KeyedTable(fleet_request_columns(), lambda r: r.key, sort="started", reverse=True,
                         title="Requests across the fleet", follow=True, id="fleet-requests")

    def on_mount(self) -> None:
        self.query_one("#fleet-gateway").border_title = "Fleet"

    @property
    def table(self) -> KeyedTable:
        return self.query_one("#fleet-requests", KeyedTable)

    def update_view(self, state: DashboardState, now: float) -> None:
        fleet = state.fleet
        shown = next((s.name for s in fleet.servers if s.url == self.shown.rstrip("/")), self.shown) if fleet else ""
        self.query_one("#fleet-gateway", Static).update(gateway_line(fleet, state.fleet_error, shown))
        if fleet is not None:
            self.query_one("#fleet-servers", KeyedTable).show(fleet.servers)
            self.table.show(fleet.recent[-REQUEST_ROWS:])

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter (or a click) on a server: the other tabs show it."""
        servers = self.query_one("#fleet-servers", KeyedTable)
        if event.data_table is not servers:
            return
        event.stop()
        chosen = servers.selected()
        if chosen is not None:
            self.post_message(ServerRequested(chosen.name))
