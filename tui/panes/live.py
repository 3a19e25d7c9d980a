"""The Live tab: budgets, the hit-ratio and TTFT graphs, the requests, counters and cache events.

The layout follows the terminal (breakpoint classes on the screen, see dashboard.tcss): below
120 columns the graphs move under the budgets and the budgets take two columns; below 32 rows
the counters and cache events make room for the requests (the Log tab has every event).
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Container, Horizontal
from textual.widgets import DataTable, Static

from apcctl.core import render
from server_patch.admin.schema import Idle, Pool
from tui import series
from tui.columns import kind_text, oracle_line, request_columns
from tui.messages import EntryRequested
from tui.panes.base import Pane
from tui.state import DashboardState, Keyed, hit_ratio, percentile
from tui.widgets.gauge import Gauge
from tui.widgets.keyed_table import KeyedTable
from tui.widgets.spark import ScaledSparkline

SPARK_POINTS = 120  # requests the per-request summaries cover (the graphs draw as many as fit)
TABLE_ROWS = 100  # requests listed
EVENT_LINES = 9  # cache events shown (the box is that tall in dashboard.tcss)
GAUGES = (  # id, label, unit
    ("ram", "RAM total", "bytes"),
    ("conversations", "conversations", "bytes"),
    ("anchor-count", "anchors", "count"),
    ("anchor-bytes", "anchor RAM", "bytes"),
    ("disk", "disk", "bytes"),
    ("pool", "MLX active", "bytes"),
)


def update_gauges(pane: "LivePane", state: DashboardState) -> None:
    b, pool = state.budgets, state.pool or Pool()
    values: dict[str, tuple[Any, Any, str]] = {  # no budgets before the cache runs: empty gauges
        "ram": (b and b.ram_used, b and b.ram_limit, f"{b.entries if b else 0} entries"),
        "conversations": (b and b.conversation_bytes, b and b.ram_limit, ""),
        "anchor-count": (b and b.pinned, b and b.anchor_count_limit,
                         f"{b.pinned_on_disk} only on disk" if b and b.pinned_on_disk else ""),
        "anchor-bytes": (b and b.anchor_bytes, b and b.anchor_bytes_limit, ""),
        "disk": (b and b.disk_used, b and b.disk_limit, f"{b.disk_files if b else 0} files"),
        "pool": (pool.active_bytes, pool.peak_bytes, f"peak, +{render.human_bytes(pool.cache_bytes or 0)} cached"),
    }
    for gauge_id, (used, limit, detail) in values.items():
        pane.query_one(f"#gauge-{gauge_id}", Gauge).set(used, limit, detail)


def counters(state: DashboardState, now: float) -> Table:
    """Cumulative counters since the server started, and the idle state a restart waits on."""
    stats, idle, hits = state.stats, state.idle or Idle(), state.hits
    by_kind = Text()
    for kind, count in sorted(hits.by_kind.items(), key=lambda kv: -kv[1]):
        by_kind.append_text(kind_text(kind))
        by_kind.append(f" {count:,}  ")
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="grey62", no_wrap=True)
    grid.add_column()
    rows = [
        ("requests", f"{hits.requests:,}  hit rate {render.percent(hits.hits, hits.requests)}"),
        ("hits by kind", by_kind),
        ("reused tokens", f"{hits.reused_tokens:,}  "
                          f"({render.percent(hits.reused_tokens, hits.reused_tokens + hits.prefill_tokens)})"
                          f" · prefilled {hits.prefill_tokens:,}"),
        ("evictions", f"{stats.get('evictions', 0):,} budget · {stats.get('operator_evictions', 0):,} operator"
                      + (f" · {stats['probe_evictions']:,} restart probe" if stats.get("probe_evictions") else "")),
        ("stores", f"{stats.get('stores', 0):,} · absorbs {stats.get('absorbs', 0):,} · "
                   f"thinned {stats.get('thinned', 0):,}"),
        ("disk writes", f"{stats.get('disk_writes', 0):,} ({render.human_bytes(stats.get('disk_bytes_written', 0))})"
                        f" · failed {stats.get('disk_write_failures', 0):,}"),
        ("in flight", f"{idle.in_flight} · queued {idle.queued} · idle "
                      f"{render.human_duration(idle.since_last_finished_s)}"),
    ]
    oracle = state.status.oracle if state.status is not None else None
    if oracle is not None:  # the live oracle (``lineage.misses``); a server before issue 26 has none
        rows.append(("oracle", oracle_line(oracle)))
    for name, value in rows:
        grid.add_row(name, value)
    return grid


def cache_events(events: list[Keyed], limit: int) -> Text:
    """Newest first: what the cache did (store, absorb, checkpoint, thin, evict, pin, disk writes)."""
    text = Text()
    for item in reversed(events[-limit:]):
        e = item.data
        size = f" {render.human_bytes(e['bytes'])}" if e.get("bytes") else ""
        text.append(f"{render.clock(e.get('time'))} ", style="grey62")
        text.append(f"{e.get('event', '?'):<12}", style="bold")
        text.append(f" {e.get('entry_id', '-')} @{e.get('length', 0):,}{size}")
        if e.get("detail"):
            text.append(f"  {e['detail']}", style="grey62")
        text.append("\n")
    text.rstrip()
    return text or Text("No cache events yet.", style="grey62")


def warming_up(state: DashboardState) -> str:
    """Why the request table is still empty while a request is in flight: a new server's first
    request waits for MLX to compile its kernels (about 15 s on the tiny model), then rows come."""
    idle = state.idle
    if idle is None or state.requests or not (idle.in_flight or idle.queued):
        return ""
    return "first request in flight: MLX compiles its kernels on a new server's first request (~15 s)"


class LivePane(Pane):
    BINDINGS = [Binding("t", "axis", "Graph axis")]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.axis = 0  # index into series.AXES
        self._state: DashboardState | None = None
        self._now = 0.0

    def compose(self) -> ComposeResult:
        with Container(id="live-top"):
            with Container(id="budgets", classes="box"):
                for gauge_id, label, unit in GAUGES:
                    yield Gauge(f"{label:<13}", unit=unit, id=f"gauge-{gauge_id}")
            with Container(id="sparks"):
                with Horizontal(classes="spark-row box", id="hits-row"):
                    yield ScaledSparkline(ceiling=1.0, id="spark-hits")
                    yield Static(id="hits-summary", classes="spark-summary")
                with Horizontal(classes="spark-row box", id="ttft-row"):
                    yield ScaledSparkline(id="spark-ttft")
                    yield Static(id="ttft-summary", classes="spark-summary")
        yield KeyedTable(request_columns(), lambda r: r.key, sort="started", reverse=True,
                         title="Requests", follow=True, id="requests")
        with Horizontal(id="live-bottom"):
            yield Static(id="counters", classes="box")
            yield Static(id="events", classes="box")

    def on_mount(self) -> None:
        self.query_one("#budgets").border_title = "Budgets"
        self.query_one("#counters").border_title = "Counters since the server started"
        self.query_one("#events").border_title = "Cache events"
        self.query_one("#hits-row").border_title = "Hit ratio"
        self.query_one("#ttft-row").border_title = "TTFT"

    @property
    def table(self) -> KeyedTable:
        return self.query_one("#requests", KeyedTable)

    def update_view(self, state: DashboardState, now: float) -> None:
        self.table.border_subtitle = warming_up(state)
        update_gauges(self, state)
        self.query_one("#counters", Static).update(counters(state, now))
        self.update_stream(state, now)

    def update_stream(self, state: DashboardState, now: float | None = None) -> None:
        """What the event stream feeds: the graphs, the request table, cache events."""
        self._state = state
        self._now = self._now if now is None else now
        self.draw_graphs()
        self.table.show(list(state.requests)[-TABLE_ROWS:])
        self.query_one("#events", Static).update(cache_events(list(state.cache_events), EVENT_LINES))

    def draw_graphs(self) -> None:
        """Both graphs and their summaries, over the last requests or the time window of ``axis``."""
        if self._state is None:
            return
        axis = series.AXES[self.axis]
        records = [r.data for r in self._state.requests]
        if axis.window_s is None:
            window, scope = records[-SPARK_POINTS:], f"last {min(len(records), SPARK_POINTS)} requests"
        else:
            window = series.in_window(records, self._now, axis.window_s)
            scope = f"last {axis.label}: {len(window)} requests"
        self.query_one("#spark-hits", ScaledSparkline).show(
            series.series(records, series.reuse, axis, self._now, series.mean))
        self.query_one("#spark-ttft", ScaledSparkline).show(series.series(records, series.ttft, axis, self._now, max))
        ttfts = [series.ttft(r) for r in window]
        ratio = hit_ratio(window)
        reused = sum(r.get("restored_tokens") or 0 for r in window)
        prompt = sum(r.get("prompt_tokens") or 0 for r in window)
        self.query_one("#hits-row").border_title = f"Hit ratio · {scope}"
        self.query_one("#hits-summary", Static).update(
            f"hits {render.percent(ratio, 1) if ratio is not None else '-'}\ntokens {render.percent(reused, prompt)}")
        self.query_one("#ttft-row").border_title = f"TTFT · {scope}"
        self.query_one("#ttft-summary", Static).update(
            f"p50 {render.ms(percentile(ttfts, 50))} ms\np95 {render.ms(percentile(ttfts, 95))} ms")

    def action_axis(self) -> None:
        """``t``: the graphs per request, or over the last minute, ten minutes, hour."""
        self.axis = (self.axis + 1) % len(series.AXES)
        self.draw_graphs()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        """Enter (or a click) on a request: open the entry it restored from."""
        if event.data_table is not self.table:
            return
        event.stop()
        record = self.table.selected()
        if record is not None:
            self.post_message(EntryRequested(record.data.get("entry_id") or ""))
