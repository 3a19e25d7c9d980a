"""The Restart tab: the plan, then each server's way through drain, wait, flush, restart, ready, probe.

It drives the restarter of ``tui.app.restarter_for`` (the same code as ``apcctl restart``: a server
behind a fleet's gateway leaves the gateway first) from a thread and draws its progress steps as
they come, server after server. While a server restarts, the rest of the dashboard shows the
connection drop and come back by itself (and the Fleet tab the server leave and rejoin the gateway).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Static

from apcctl.core.restart import Phase, RestartResult, RestartStep
from tui.messages import PollRequested, RestartRequested
from tui.panes.base import Pane

Restarter = Callable[..., RestartResult]  # called as restarter(on_progress=..., dry_run=...)
STEPS = ((Phase.DRAINING, "drain"), (Phase.WAITING, "wait idle"), (Phase.FLUSHING, "flush"),
         (Phase.STOPPING, "stop"), (Phase.STARTING, "start"), (Phase.READY, "ready"),
         (Phase.PROBING, "anchor probe"), (Phase.DONE, "done"))
ORDER = [phase for phase, _ in STEPS]
LOG_LINES = 14


def stepper(steps: Sequence[RestartStep]) -> Text:
    """``✓ drain ✓ wait idle ● flush ○ stop ...`` for one server's steps so far."""
    reached = [s.phase for s in steps if s.phase in ORDER]
    failed = any(s.phase == Phase.FAILED for s in steps)
    current = ORDER.index(reached[-1]) if reached else -1
    text = Text()
    for index, (phase, label) in enumerate(STEPS):
        if index < current or (index == current and phase == Phase.DONE):
            mark, style = "✓", "green"
        elif index == current:
            mark, style = ("✗", "bold red") if failed else ("●", "bold yellow")
        else:
            mark, style = "○", "grey42"
        if phase == Phase.WAITING and index == current and not failed:
            label = f"wait idle ({steps[-1].in_flight} in flight)"
        text.append(f"{mark} {label}  ", style=style)
    return text


def progress_view(servers: Sequence[str], steps: Sequence[RestartStep], result: RestartResult | None) -> Group:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    table.add_column(style="grey62", justify="right")
    for server in servers:
        mine = [s for s in steps if s.server == server and s.phase != Phase.PLAN]
        elapsed = f"{getattr(mine[-1], 'elapsed_s', 0.0):.1f}s" if mine else ""
        table.add_row(server, stepper(mine) if mine else Text("waiting its turn", style="grey62"), elapsed)
    parts: list[Any] = [table]
    if result is not None:
        failed = next((s for s in result.servers if not s.ok and s.phase == Phase.FAILED), None)
        if result.ok:
            parts.append(Text(f"✓ restarted {len(result.servers)} server(s): "
                              + ", ".join(f"{s.server} pid {s.old_pid} -> {s.new_pid}" for s in result.servers),
                              style="bold green"))
        else:
            where = f"{failed.server}: {failed.message}" if failed else "see the log"
            parts.append(Text(f"✗ the roll stopped at {where}; later servers were not touched", style="bold red"))
    return Group(*parts)


def log_view(steps: Sequence[RestartStep]) -> Text:
    text = Text()
    for step in steps[-LOG_LINES:]:
        style = "yellow" if step.message.startswith("warning:") else "red" if step.phase == Phase.FAILED else ""
        text.append(f"{getattr(step, 'elapsed_s', 0.0):6.1f}s ", style="grey62")
        text.append(f"{step.server:<12} {step.phase:<9} ", style="bold")
        text.append(f"{step.message}\n", style=style)
    text.rstrip()
    return text


class RestartPane(Pane, can_focus=True):
    """Focusable itself (it has no table), so its key works as soon as the tab is shown."""

    BINDINGS = [Binding("R", "restart", "Restart servers")]

    def __init__(self, restarter: Restarter | None, *, read_only: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.restarter = restarter
        self.read_only = read_only
        self.plan: list[RestartStep] = []
        self.steps: list[RestartStep] = []
        self.result: RestartResult | None = None
        self.running = False

    def compose(self) -> ComposeResult:
        yield Static(id="restart-plan", classes="box")
        yield Static(id="restart-progress", classes="box")
        yield Static(id="restart-log", classes="box")

    def on_mount(self) -> None:
        self.query_one("#restart-plan").border_title = "Plan"
        self.query_one("#restart-progress").border_title = "Progress"
        self.query_one("#restart-log").border_title = "Steps"
        if self.restarter is None:
            self.query_one("#restart-plan", Static).update(Text(
                "No restart target: open the dashboard with 'apcctl top --server NAME' for a server in the "
                "config file or one started by 'apcctl serve', so it can be started again.", style="grey62"))
        else:
            self._dry_run()
        self._redraw()

    @work(thread=True, group="restart-plan", exit_on_error=False)
    def _dry_run(self) -> None:
        plan: list[RestartStep] = []
        self.restarter(on_progress=plan.append, dry_run=True)
        self.app.call_from_thread(self._planned, plan)

    def _planned(self, plan: list[RestartStep]) -> None:
        self.plan = plan
        self.refresh_bindings()
        self._redraw()

    @property
    def servers(self) -> list[str]:
        return list(dict.fromkeys(s.server for s in self.plan + self.steps))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "restart":
            if self.read_only or self.restarter is None:
                return False
            refused = any(step.phase == Phase.FAILED for step in self.plan)  # the dry run says it cannot work
            return None if self.running or refused else True
        return True

    def action_restart(self) -> None:
        self.post_message(RestartRequested())

    def start(self) -> None:
        """Run the roll (the app has confirmed it)."""
        self.steps, self.result, self.running = [], None, True
        self.refresh_bindings()
        self._roll()

    @work(thread=True, group="restart", exit_on_error=False)
    def _roll(self) -> None:
        try:
            result = self.restarter(on_progress=lambda step: self.app.call_from_thread(self.add_step, step))
        except Exception as exc:  # a bug or an unexpected error must still end the roll on screen
            self.app.call_from_thread(self.add_step, RestartStep("dashboard", Phase.FAILED, message=str(exc)))
            result = None
        self.app.call_from_thread(self.finished, result)

    def add_step(self, step: RestartStep) -> None:
        self.steps.append(step)
        self._redraw()
        if step.phase in (Phase.READY, Phase.DONE, Phase.FAILED):  # a new (or the old) process answers
            self.post_message(PollRequested())

    def finished(self, result: RestartResult | None) -> None:
        self.result, self.running = result, False
        self.refresh_bindings()
        self._redraw()
        self.post_message(PollRequested())  # the header shows the server as it is now, not as it was lost

    def _redraw(self) -> None:
        if self.plan:
            plan = Text()
            for step in self.plan:
                plan.append(f"{step.server:<12} ", style="bold")
                plan.append(f"{step.phase:<7} {step.message}\n", style="red" if step.phase == Phase.FAILED else "")
            if any(step.phase == Phase.FAILED for step in self.plan):
                plan.append("The plan was refused, so R is off: see apcctl restart --help.", style="grey62")
            else:
                plan.append("R starts the roll (after a confirmation); one server at a time, the first failure "
                            "stops it.", style="grey62")
            self.query_one("#restart-plan", Static).update(plan)
        if self.servers:
            self.query_one("#restart-progress", Static).update(progress_view(self.servers, self.steps, self.result))
        steps = [s for s in self.steps if s.phase != Phase.PLAN]  # the plan has its own box
        self.query_one("#restart-log", Static).update(
            log_view(steps) if steps else Text("Not started.", style="grey62"))
