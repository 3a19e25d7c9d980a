"""``apcctl top``: the dashboard an operator keeps open beside the server.

Two threads feed it. A one-shot poll worker takes a snapshot (status, entries, process);
when it finishes, the app renders and arms the next poll, so polls never overlap and a
dead server is simply retried (with backoff) until it answers again. A long-lived event
worker follows the server's event stream and reconnects by itself. Both only touch the UI
through messages and worker events; all state lives in ``DashboardState`` on the UI thread.

With a fleet (``apcctl top --fleet``) a third thread polls the fleet the same way (gateway
``GET /workers``, each server's status and recent requests: ``tui.fleet``) for the Fleet tab,
and the Restart tab rolls the fleet's servers through the gateway.

``make_app(source, ...)`` builds the app for the CLI, the demo and the tests alike;
``run_dashboard(client, ...)`` runs it against a live server.
"""

from __future__ import annotations

import functools
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Input, TabbedContent, TabPane
from textual.worker import Worker, WorkerState

from apcctl.core import render
from apcctl.core.client import AdminClient
from tui import impact
from tui.fleet import FleetSource
from tui.messages import (EntryRequested, EventsArrived, NewAnchorRequested, PollRequested, RestartRequested,
                          ServerRequested, VerbRequested)
from tui.panes.base import Pane
from tui.panes.entries import AnchorsPane, LineagesPane
from tui.panes.fleet import FleetPane
from tui.panes.live import LivePane
from tui.panes.log import LogPane
from tui.panes.restart import Restarter, RestartPane
from tui.screens.anchor_file import AnchorFileScreen
from tui.screens.confirm import ConfirmScreen
from tui.screens.help import HelpScreen
from tui.source import DashboardSource, LiveSource, SourceError
from tui.state import DashboardState
from tui.widgets.footer import KeysFooter
from tui.widgets.header import Mode, ServerHeader

TABS = (("live", "Live"), ("lineages", "Lineages"), ("anchors", "Anchors"), ("restart", "Restart"), ("log", "Log"),
        ("fleet", "Fleet"))  # Fleet only with a fleet
REFRESH_STEPS = (0.5, 1.0, 2.0, 5.0, 10.0)
MAX_BACKOFF_S = 5.0


class DashboardApp(App[None]):
    """The dashboard over any ``DashboardSource``."""

    CSS_PATH = Path(__file__).with_name("dashboard.tcss")
    TITLE = "apcctl top"
    AUTO_FOCUS = "#requests"
    # Classes on the screen that dashboard.tcss lays the Live tab out by (any size down to 80x24).
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]
    # Help and Quit are drawn first by KeysFooter (a narrow footer cuts its right end).
    BINDINGS = [
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),  # as htop and k9s quit
        *(Binding(str(n), f"show_tab('{tab}')", label, show=False) for n, (tab, label) in enumerate(TABS, 1)),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
        Binding("space", "pause", "Pause"),
        Binding("r", "refresh", "Refresh"),
        Binding("plus", "interval(1)", "Slower", show=False),
        Binding("minus", "interval(-1)", "Faster", show=False),
    ]

    def __init__(self, source: DashboardSource, *, read_only: bool = False, restarter: Restarter | None = None,
                 refresh_s: float = 1.0, fleet: FleetSource | None = None,
                 notices: Callable[[], str] | None = None) -> None:
        super().__init__()
        self.source = source
        self.notices = notices  # what the caller has to say (the demo: its traffic is done), asked each poll
        self._told: set[str] = set()
        self.fleet = fleet
        self.read_only = read_only
        self.restarter = restarter
        self.refresh_s = refresh_s
        self.paused = False
        self.state = DashboardState()
        self.polls = 0  # finished polls, successful or not (tests wait on it)
        self.fleet_polls = 0  # the same for the fleet view
        self.closing = threading.Event()  # set on unmount: every thread of the app stops on it
        # (generation, event, data): a Fleet pick (``show_server``) starts a new generation, and an
        # event the previous server's stream queued is dropped.
        self._inbox: queue.SimpleQueue[tuple[int, str, dict[str, Any]]] = queue.SimpleQueue()
        self._generation = 0
        self._follow_stop = threading.Event()  # ends the current server's stream (a pick, or closing)
        self._woken = threading.Event()
        self._poll_timer: Any = None
        self._backoff = 0.5
        self._fleet_timer: Any = None
        self._fleet_backoff = 0.5

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield ServerHeader(id="header")
        with TabbedContent(initial="live", id="tabs"):
            with TabPane("1 Live", id="live"):
                yield LivePane(id="pane-live")
            with TabPane("2 Lineages", id="lineages"):
                yield LineagesPane(read_only=self.read_only, id="pane-lineages")
            with TabPane("3 Anchors", id="anchors"):
                yield AnchorsPane(read_only=self.read_only, id="pane-anchors")
            with TabPane("4 Restart", id="restart"):
                yield RestartPane(self.restarter, read_only=self.read_only, id="pane-restart")
            with TabPane("5 Log", id="log"):
                yield LogPane(id="pane-log")
            if self.fleet is not None:
                with TabPane("6 Fleet", id="fleet"):
                    yield FleetPane(id="pane-fleet")
        yield Input(placeholder="filter: text, or !text to hide matches", id="filter", disabled=True)
        yield KeysFooter()

    def on_mount(self) -> None:
        self.query_one("#filter", Input).cursor_blink = False
        self._render_header()
        self.poll_now()
        self._follow()
        if self.fleet is not None:
            self._poll_fleet()

    def on_unmount(self) -> None:
        self.closing.set()  # ends the event thread within a keepalive, so the process can exit
        self._follow_stop.set()

    @property
    def caught_up(self) -> bool:
        """A poll has been drawn and no streamed event waits to be: what tests and screenshots wait for."""
        fleet_drawn = self.fleet is None or self.fleet_polls > 0
        return self.polls > 0 and fleet_drawn and self._inbox.empty() and not self._woken.is_set()

    @property
    def panes(self) -> list[Pane]:
        return list(self.query(Pane))

    @property
    def active_pane(self) -> Pane:
        return self.query_one(f"#pane-{self.query_one(TabbedContent).active}", Pane)

    # ------------------------------------------------------------------ polling

    def poll_now(self) -> None:
        if self._poll_timer is not None:
            self._poll_timer.stop()
            self._poll_timer = None
        self._poll()

    @work(thread=True, exclusive=True, group="poll", exit_on_error=False)
    def _poll(self) -> Any:
        source = self.source
        return source, source.snapshot()

    @work(thread=True, exclusive=True, group="fleet-poll", exit_on_error=False)
    def _poll_fleet(self) -> Any:
        assert self.fleet is not None
        return self.fleet.snapshot()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        worker = event.worker
        if worker.group not in ("poll", "fleet-poll") or event.state not in (WorkerState.SUCCESS, WorkerState.ERROR):
            return
        if not self._screen_is_up():  # a poll that finished while the app was shutting down
            return
        if worker.group == "fleet-poll":
            self._fleet_polled(worker.result if event.state == WorkerState.SUCCESS else None, worker.error)
            return
        if event.state == WorkerState.SUCCESS:
            source, snapshot = worker.result
            if source is not self.source:  # asked of the server shown before a Fleet pick
                return
            self.state.apply_snapshot(snapshot)
            self._backoff = 0.5
            delay = self.refresh_s
        else:
            self.state.poll_failed(str(worker.error))
            delay, self._backoff = self._backoff, min(MAX_BACKOFF_S, self._backoff * 2)
        self.polls += 1
        self.render_all()
        self._tell_notices()
        self._poll_timer = self.set_timer(delay, self.poll_now)

    def _tell_notices(self) -> None:
        """Each new line the caller's ``notices`` has, once, as a notification."""
        said = self.notices() if self.notices is not None else ""
        if said and said not in self._told:
            self._told.add(said)
            self.notify(said, timeout=30)

    def _fleet_polled(self, fleet: Any, error: BaseException | None) -> None:
        """The fleet's own poll-render-reschedule: draw the Fleet tab, arm the next fleet poll."""
        if fleet is not None:
            self.state.apply_fleet(fleet)
            self._fleet_backoff, delay = 0.5, self.refresh_s
        else:
            self.state.fleet_failed(str(error))
            delay, self._fleet_backoff = self._fleet_backoff, min(MAX_BACKOFF_S, self._fleet_backoff * 2)
        self.fleet_polls += 1
        if not self.paused:
            pane = self.query_one(FleetPane)
            pane.shown = self.source.name if hasattr(self.fleet, "source_for") else ""  # a picker: say which
            pane.update_view(self.state, self.source.now())
        self._fleet_timer = self.set_timer(delay, self._poll_fleet)

    # ------------------------------------------------------------------ the event stream

    @work(thread=True, group="events", exit_on_error=False)
    def _follow(self) -> None:
        """Follow the stream for the app's life; reconnect at once after a good connection, else back off."""
        backoff = 0.5
        source, stop, generation = self.source, self._follow_stop, self._generation  # this server's stream
        while not stop.is_set():
            connected = threading.Event()

            def emit(name: str, data: dict[str, Any]) -> None:
                if name == "hello":
                    connected.set()
                self._emit(name, data, generation)

            try:
                source.follow(emit, stop)
                error = "the event stream ended"
            except SourceError as exc:
                error = str(exc)
            if stop.is_set():
                return
            self._emit("lost", {"error": error}, generation)
            backoff = 0.5 if connected.is_set() else min(MAX_BACKOFF_S, backoff * 2)
            stop.wait(backoff)

    def _emit(self, name: str, data: dict[str, Any], generation: int) -> None:
        """Runs on the event thread: queue the event, and wake the UI once for however many follow."""
        self._inbox.put((generation, name, data))
        if not self._woken.is_set():
            self._woken.set()
            self.post_message(EventsArrived())

    def on_events_arrived(self, _: EventsArrived) -> None:
        self._woken.clear()
        if not self._screen_is_up():
            return
        fresh = False
        while True:
            try:
                generation, name, data = self._inbox.get_nowait()
            except queue.Empty:
                break
            if generation != self._generation:
                continue
            if name == "lost":
                self.state.stream_state("lost", data["error"])
                fresh = True
            else:
                fresh = self.state.apply_event(name, data) is not None or name == "hello" or fresh
        if fresh:
            self._render_header()
            if not self.paused:
                self.query_one(LivePane).update_stream(self.state, self.source.now())
                self.query_one(LogPane).update_stream(self.state)

    # ------------------------------------------------------------------ rendering

    def _screen_is_up(self) -> bool:
        """False once the app is closing and its widgets are gone (messages may still arrive)."""
        return not self.closing.is_set() and bool(self.query(ServerHeader))

    def _render_header(self) -> None:
        mode = Mode(paused=self.paused, read_only=self.read_only, refresh_s=self.refresh_s)
        self.query_one(ServerHeader).show(self.state, self.source.name, mode)

    def render_all(self) -> None:
        """The header always (it shows the connection); the panes unless paused."""
        self._render_header()
        if self.paused:
            return
        now = self.source.now()
        for pane in self.panes:
            pane.update_view(self.state, now)

    # ------------------------------------------------------------------ keys

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "filter":
            return self.active_pane.table is not None
        if action == "show_tab" and parameters == ("fleet",):
            return self.fleet is not None
        return True

    def on_tabbed_content_tab_activated(self) -> None:
        self.refresh_bindings()  # the footer offers / only where there is a table

    def action_show_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        table = self.active_pane.table
        (table or self.active_pane).focus()

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.render_all()

    def action_refresh(self) -> None:
        self.poll_now()
        if self.fleet is not None:
            if self._fleet_timer is not None:
                self._fleet_timer.stop()
            self._poll_fleet()

    def action_interval(self, step: int) -> None:
        index = min(range(len(REFRESH_STEPS)), key=lambda i: abs(REFRESH_STEPS[i] - self.refresh_s))
        self.refresh_s = REFRESH_STEPS[max(0, min(len(REFRESH_STEPS) - 1, index + step))]
        self._render_header()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_filter(self) -> None:
        table = self.active_pane.table
        if table is None:
            self.notify("This tab has nothing to filter.", severity="warning")
            return
        field = self.query_one("#filter", Input)
        field.value = table.filter_text
        field.disabled = False
        field.add_class("visible")
        field.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        table = self.active_pane.table
        if table is not None:
            table.set_query(event.value)

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self._close_filter()

    def action_clear_filter(self) -> None:
        """Escape: drop the tab's filter (k9s does the same) and leave the filter field."""
        table = self.active_pane.table
        if table is not None:
            table.set_query("")
        self.query_one("#filter", Input).value = ""
        self._close_filter()

    def _close_filter(self) -> None:
        field = self.query_one("#filter", Input)
        field.remove_class("visible")
        field.disabled = True  # hidden, it must never take the keys
        (self.active_pane.table or self.active_pane).focus()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for tab, label in TABS:
            if tab == "fleet" and self.fleet is None:
                continue
            yield SystemCommand(f"Go to {label}", f"Show the {label} tab", functools.partial(self.action_show_tab, tab))
        yield SystemCommand("Pause or resume", "Hold the screen still; data keeps coming", self.action_pause)
        yield SystemCommand("Refresh now", "Poll the server now", self.action_refresh)
        yield SystemCommand("Keys", "Every key of the dashboard", self.action_help)

    # ------------------------------------------------------------------ verbs (confirmed, then run in a thread)

    def on_verb_requested(self, message: VerbRequested) -> None:
        if self.read_only:
            return
        entry = self.state.entry(message.entry_id)
        if entry is None:
            self.notify(f"{self.state.where_gone(message.entry_id)} (refresh to see the latest entries).",
                        severity="warning")
            return
        describe = {"pin": impact.pin, "unpin": impact.unpin, "evict": impact.evict}[message.verb]
        verb = getattr(self.source, message.verb)
        self._confirm(describe(entry, self.state.budgets), functools.partial(verb, entry.id))

    def on_new_anchor_requested(self, _: NewAnchorRequested) -> None:
        if self.read_only:
            return

        def chosen(path: Path | None) -> None:
            if path is None:
                return
            try:
                system, tools = impact.read_anchor_file(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as exc:
                self.notify(f"cannot read {path}: {exc}", severity="error")
                return
            described = impact.new_anchor(str(path), system, tools, self.state.budgets, self.state.entries)
            self._confirm(described, functools.partial(self.source.new_anchor, system, tools))

        self.push_screen(AnchorFileScreen(), chosen)

    def on_restart_requested(self, _: RestartRequested) -> None:
        pane = self.query_one(RestartPane)
        if self.read_only or pane.restarter is None or pane.running:
            return
        in_flight = self.state.status.idle.in_flight if self.state.status else "?"
        servers = ", ".join(pane.servers) or "the target"
        first = ("take it out of the gateway (the other servers get its new requests), then drain"
                 if self.fleet is not None else "drain (new requests get 503 with Retry-After)")
        body = (f"Restart {servers}, one at a time: {first}, wait until "
                f"nothing is in flight ({in_flight} now), flush RAM entries to disk, stop, start, "
                "wait until ready, then probe that an anchor restores from disk"
                + (", and put it back in the gateway" if self.fleet is not None else "") + ".\n"
                "The first failure stops the roll and lifts the drain.")
        self._confirm(impact.Impact("Rolling restart", body, "Restart"), None, then=pane.start)

    def _confirm(self, described: impact.Impact, call: Any, then: Any = None) -> None:
        def answered(yes: bool | None) -> None:
            if not yes:
                return
            if call is not None:
                self._perform(described.title, call)
            if then is not None:
                then()

        self.push_screen(ConfirmScreen(described), answered)

    @work(thread=True, group="verbs", exit_on_error=False)
    def _perform(self, title: str, call: Any) -> None:
        try:
            answer = call()
        except SourceError as exc:
            self.call_from_thread(self.notify, f"{title} failed: {exc}", severity="error", timeout=8)
            return
        self.call_from_thread(self._performed, title, answer)

    def on_server_requested(self, message: ServerRequested) -> None:
        """Enter on a Fleet row: show that server in every other tab (``fleet top``'s picker)."""
        picker = getattr(self.fleet, "source_for", None)  # a fixed snapshot has no servers to ask
        source = picker(message.name) if picker is not None else None
        if source is None:
            self.notify(f"{message.name}: this fleet view cannot show its servers.", severity="warning")
            return
        self.show_server(source)
        self.notify(f"Showing {message.name} in the Live, Lineages, Anchors and Log tabs.")
        self.action_show_tab("live")

    def show_server(self, source: DashboardSource) -> None:
        """From now on every tab but Fleet shows ``source``: its stream replaces the last one, and
        nothing the last server said (a poll or an event still on its way) is drawn."""
        self._follow_stop.set()
        fleet, fleet_error = self.state.fleet, self.state.fleet_error
        self.source, self.state = source, DashboardState()
        self.state.fleet, self.state.fleet_error = fleet, fleet_error
        self._generation += 1
        self._follow_stop = threading.Event()
        self._backoff = 0.5
        self._follow()
        self.poll_now()
        self.render_all()

    def on_poll_requested(self, _: PollRequested) -> None:
        """Poll now, without the backoff a lost server built up (a restart just brought it back)."""
        self._backoff = 0.5
        self.poll_now()

    def on_entry_requested(self, message: EntryRequested) -> None:
        """A request row was chosen: its entry, selected in the Lineages tab (drill-down)."""
        if not message.entry_id:
            self.notify("A cold request: it restored nothing, so there is no entry to show.", severity="warning")
            return
        entry_id = message.entry_id
        if self.state.entry(entry_id) is None:
            into = self.state.successor(entry_id)
            if into is None or self.state.entry(into) is None:
                self.notify(f"{self.state.where_gone(entry_id)}.", severity="warning")
                return
            self.notify(f"{self.state.where_gone(entry_id)}: showing that one.")
            entry_id = into
        pane = self.query_one(LineagesPane)
        self.action_show_tab("lineages")
        if not pane.table.select_key(entry_id):  # hidden by the tab's filter
            pane.table.set_query("")
            pane.table.select_key(entry_id)

    def _performed(self, title: str, answer: Any) -> None:
        freed = getattr(answer, "freed_bytes", None)  # an eviction's answer (``schema.Evicted``)
        self.notify(f"{title}: done" + (f", freed {render.human_bytes(freed)}" if freed is not None else ""))
        self.poll_now()


def make_app(source: DashboardSource, *, read_only: bool = False, restarter: Restarter | None = None,
             refresh_s: float = 1.0, fleet: FleetSource | None = None,
             notices: Callable[[], str] | None = None) -> DashboardApp:
    """The one way to build the dashboard: the CLI, the demo and the tests all come through here."""
    return DashboardApp(source, read_only=read_only, restarter=restarter, refresh_s=refresh_s, fleet=fleet,
                        notices=notices)


def restarter_for(targets: Sequence[Any] | None) -> Restarter | None:
    """A restarter over ``targets`` (``apcctl.config.Target``), in order, or None.

    The plan is ``apcctl.core.restart.rolling_restart``'s dry run; the roll is
    ``apcctl.core.roll.restart_targets``, as ``apcctl restart`` runs it: a server behind a running
    fleet's gateway leaves the gateway first and rejoins it after, so the fleet's clients never
    get a 503, and the Restart tab follows the roll from server to server."""
    if not targets:
        return None
    chosen = list(targets)

    def restart(*, on_progress: Any, dry_run: bool = False) -> Any:
        from apcctl.core.restart import rolling_restart
        from apcctl.core.roll import restart_targets

        if dry_run:
            return rolling_restart(chosen, on_progress=on_progress, dry_run=True)
        return restart_targets(chosen, on_progress=on_progress)

    return restart


def run_dashboard(client: AdminClient, *, read_only: bool = False, restart_targets: Sequence[Any] | None = None,
                  refresh_s: float = 1.0, fleet: FleetSource | None = None,
                  notices: Callable[[], str] | None = None) -> None:
    """Open the dashboard on ``client``'s server until the operator quits.

    Args:
        read_only: hide every verb that changes the server (pin, unpin, evict, new anchor, restart).
        restart_targets: ``apcctl.config.Target`` list the Restart tab restarts; None leaves it off.
        refresh_s: seconds between polls (``+``/``-`` change it inside).
        fleet: the fleet ``client``'s server belongs to, for the Fleet tab (``tui.fleet``).
        notices: asked after every poll; each new line it returns is shown once (the demo: its
            traffic is done).
    """
    make_app(LiveSource(client), read_only=read_only, restarter=restarter_for(restart_targets),
             refresh_s=refresh_s, fleet=fleet, notices=notices).run()
