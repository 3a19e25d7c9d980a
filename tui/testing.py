"""Helpers for driving the dashboard headless: waiting on it, and a scripted rolling restart.

Used by the pilot and snapshot tests and by the screenshot script in docs/dashboard.md. Waits
are on the app's state, never on the clock.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any, Awaitable, Callable

from textual.pilot import Pilot
from textual.widget import Widget

from apcctl.core.restart import Phase, RestartResult, RestartStep, ServerRestart
from tui.app import DashboardApp
from tui.fleet import FleetServer, FleetSnapshot
from tui.state import Keyed

PHASES = ((Phase.DRAINING, 0, "new requests get 503, Retry-After 5s"), (Phase.WAITING, 2, "2 in flight"),
          (Phase.WAITING, 1, "1 in flight"), (Phase.WAITING, 0, "0 in flight"),
          (Phase.FLUSHING, 0, "writing RAM entries the disk lacks"), (Phase.STOPPING, 0, "SIGTERM, then start again"),
          (Phase.STARTING, 0, ""), (Phase.READY, 0, "pid 4242 answers /health and /admin/status"),
          (Phase.PROBING, 0, "a request with the probe's system prompt must restore from disk"),
          (Phase.DONE, 0, "pid 4141 -> 4242"))


def sync(test: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    """Run an ``async def`` test in its own event loop (no pytest async plugin needed)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(test(*args, **kwargs))

    return run


def text_of(widget: Widget) -> str:
    """What ``widget`` shows on screen now, as plain text."""
    return "\n".join(widget.render_line(y).text for y in range(widget.size.height))


async def wait_for(pilot: Pilot, condition: Callable[[], bool]) -> None:
    """Let the app run until ``condition()`` holds (pytest's timeout bounds a hang)."""
    while not condition():
        await pilot.pause(0.05)


async def settle(pilot: Pilot) -> None:
    """Until the first poll is drawn and every event delivered so far is drawn too."""
    app = pilot.app
    assert isinstance(app, DashboardApp)
    replayed = getattr(app.source, "replayed", None)
    await wait_for(pilot, lambda: app.caught_up and (replayed is None or replayed.is_set()))
    await pilot.pause()
    await wait_for(pilot, lambda: app.caught_up)
    await pilot.pause()


class ScriptedRestarter:
    """Plays a rolling restart's steps with fixed timings; ``hold_at`` stops before that step until ``release``."""

    def __init__(self, servers: tuple[str, ...] = ("main",), hold_at: int | None = None,
                 hold_server: str | None = None) -> None:
        self.servers = servers
        self.hold_at = hold_at
        self.hold_server = hold_server or servers[0]  # whose step ``hold_at`` waits before
        self.held = threading.Event()
        self._release = threading.Event()
        self.abandon: threading.Event | None = None  # e.g. the app's ``closing``: stop holding when it is set
        self.runs = 0

    def release(self) -> None:
        self._release.set()

    def _hold(self) -> None:
        self.held.set()
        while not self._release.wait(0.05):
            if self.abandon is not None and self.abandon.is_set():
                return

    def __call__(self, *, on_progress: Callable[[RestartStep], None], dry_run: bool = False) -> RestartResult:
        for server in self.servers:
            on_progress(RestartStep(server, Phase.PLAN, message="drain, wait <= 300s, flush, SIGTERM, then start "
                                    "again, wait ready, probe an anchor from disk"))
        if dry_run:
            return RestartResult(True, True, [ServerRestart(server=s) for s in self.servers])
        self.runs += 1
        results = []
        for server in self.servers:
            for index, (phase, in_flight, message) in enumerate(PHASES):
                if self.hold_at is not None and index == self.hold_at and server == self.hold_server:
                    self._hold()
                on_progress(RestartStep(server, phase, in_flight, message, elapsed_s=0.5 * index))
            results.append(ServerRestart(server=server, ok=True, phase=Phase.DONE, old_pid=4141, new_pid=4242))
        return RestartResult(True, False, results)


def recorded_fleet(recording: dict[str, Any]) -> FleetSnapshot:
    """Three servers made from one recording: fleet-1 healthy, fleet-2 draining out of the gateway
    (mid-roll), fleet-3 absent and not answering; the recorded requests dealt out between the first
    two in turn, as a gateway might have sent them."""
    status = recording["status"]
    draining = {**status, "idle": {**status["idle"], "draining": True, "in_flight": 1},
                "server": {**status["server"], "pid": status["server"]["pid"] + 1}}
    servers = [FleetServer("fleet-1", "http://127.0.0.1:30001", "healthy", 2, status),
               FleetServer("fleet-2", "http://127.0.0.1:30002", "draining", 1, draining),
               FleetServer("fleet-3", "http://127.0.0.1:30003", "absent", None, None,
                           "cannot reach http://127.0.0.1:30003: [Errno 111] Connection refused")]
    requests = [data for name, data in recording["events"] if name == "request"]
    recent = [Keyed(f"fleet-{1 + n % 2}:{r['seq']}", {**r, "server": f"fleet-{1 + n % 2}"})
              for n, r in enumerate(requests)]
    return FleetSnapshot("http://127.0.0.1:30000", "cache_aware", servers, recent, taken=float(recording["now"]))
