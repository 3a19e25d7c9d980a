"""Everything the dashboard knows, as plain data updated on the UI thread.

Snapshots (polled) replace status and entries; events (streamed) append requests and cache
events. Sequence numbers dedupe events, because every reconnect replays the server's ring.
A server restart starts those numbers at 1 again: the ``hello`` event (and the status's pid and
start time) tell a restart from a reconnect, and reset the dedupe. Panes render from this
object and never from the source.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from apcctl.core.client import hits_of
from apcctl.core.process import ProcessInfo
from tui.source import Snapshot

if TYPE_CHECKING:
    from server_patch.admin.schema import Budgets, EntryInfo, Hits, Idle, LineageInfo, Pool, ServerInfo, Status
    from tui.fleet import FleetSnapshot

HISTORY = 600  # cache events kept
REQUEST_HISTORY = 5000  # requests kept: the table shows the newest, the graphs an hour of them
LOG_LINES = 2000  # what the Log tab can still draw
REQUEST_ENDED = "request_ended"  # the event stream's final record of a request whose row ended later


@dataclass(frozen=True)
class LogItem:
    """One line of the Log tab: a streamed ``request``/``cache`` event, or a ``note`` of the dashboard's own."""

    number: int  # counts every item ever logged, so a pane knows what it already wrote
    kind: str
    data: dict[str, Any]


@dataclass
class Connection:
    """How the dashboard is doing at reaching the server."""

    state: str = "connecting"  # connecting | live | lost
    error: str = ""
    failures: int = 0  # consecutive failed polls
    reconnects: int = 0  # times it was lost and came back
    stream: str = "connecting"  # the event stream: connecting | live | lost
    stream_error: str = ""


@dataclass(frozen=True)
class ServerIdentity:
    """One server process: a restart changes the pid and the start time."""

    pid: int | None
    started: float | None

    @classmethod
    def of(cls, server: ServerInfo) -> "ServerIdentity":
        started = server.started
        return cls(server.pid, None if started is None else round(float(started), 3))


@dataclass(frozen=True)
class Keyed:
    """A streamed record and the row key it keeps for its whole life (pid and sequence number)."""

    key: str
    data: dict[str, Any]


@dataclass
class DashboardState:
    history: int = HISTORY
    status: Status | None = None  # the last poll's answers, typed (``server_patch.admin.schema``)
    entries: list[EntryInfo] = field(default_factory=list)
    process: ProcessInfo | None = None
    taken: float | None = None
    connection: Connection = field(default_factory=Connection)
    server: ServerIdentity | None = None
    restarts_seen: int = 0
    fleet: "FleetSnapshot | None" = None  # the fleet view's last poll (apcctl top --fleet)
    fleet_error: str = ""  # why the last fleet poll failed; "" after a good one

    def __post_init__(self) -> None:
        self.requests: deque[Keyed] = deque(maxlen=max(self.history, REQUEST_HISTORY))
        self.cache_events: deque[Keyed] = deque(maxlen=self.history)
        self.log: deque[LogItem] = deque(maxlen=LOG_LINES)
        self.logged = 0
        self._seen = {"request": 0, "cache": 0}

    def note(self, text: str, at: float | None = None, style: str = "yellow") -> None:
        """A line of the dashboard's own in the Log tab (lost, back, a restarted server)."""
        self._log("note", {"text": text, "time": at, "style": style})

    def _log(self, kind: str, data: dict[str, Any]) -> None:
        self.logged += 1
        self.log.append(LogItem(self.logged, kind, data))

    # ------------------------------------------------------------------ inputs

    def apply_snapshot(self, snapshot: Snapshot) -> None:
        self.identify(ServerIdentity.of(snapshot.status.server))
        self.status, self.entries = snapshot.status, snapshot.entries
        self.process, self.taken = snapshot.process, snapshot.taken
        if self.connection.state == "lost":
            self.connection.reconnects += 1
            self.note("the server answers again", snapshot.taken, "green")
        self.connection.state, self.connection.error, self.connection.failures = "live", "", 0

    def poll_failed(self, error: str) -> None:
        if self.connection.state == "live":
            self.note(f"lost the server: {error}", style="red")
        self.connection.state = "lost" if self.connection.state != "connecting" else "connecting"
        self.connection.error = error
        self.connection.failures += 1

    def apply_fleet(self, fleet: "FleetSnapshot") -> None:
        self.fleet, self.fleet_error = fleet, ""

    def fleet_failed(self, error: str) -> None:
        self.fleet_error = error  # the last good view stays on screen, with the error beside it

    def stream_state(self, state: str, error: str = "") -> None:
        self.connection.stream, self.connection.stream_error = state, error

    def apply_event(self, name: str, data: dict[str, Any]) -> str | None:
        """Take one streamed event; returns ``"request"``/``"cache"`` when something new was added
        (or, for ``request_ended``, a request's record changed)."""
        if name == "hello":
            self.identify(ServerIdentity(data.get("pid"), None if data.get("started") is None
                                         else round(float(data["started"]), 3)))
            self.stream_state("live")
            return None
        if name == REQUEST_ENDED:
            return "request" if self.request_ended(data) else None
        if name not in self._seen:
            return None
        seq = int(data.get("seq", 0))
        if seq <= self._seen[name]:
            return None
        self._seen[name] = seq
        pid = self.server.pid if self.server else None
        target = self.requests if name == "request" else self.cache_events
        target.append(Keyed(f"{pid}:{seq}", data))
        self._log(name, data)
        return name

    def request_ended(self, data: dict[str, Any]) -> bool:
        """A request's row ended after its record came (its waits final, ``integration.waits``):
        the record kept is brought up to date in place. False when it is not kept (or unchanged)."""
        key = f"{self.server.pid if self.server else None}:{data.get('seq')}"
        for keyed in reversed(self.requests):
            if keyed.key == key:
                changed = any(keyed.data.get(k) != v for k, v in data.items())
                keyed.data.update(data)
                return changed
        return False

    def identify(self, server: ServerIdentity) -> None:
        """A different process than before: its sequence numbers start again."""
        if server == self.server:
            return
        if self.server is not None:
            self.restarts_seen += 1
            self.note(f"the server restarted: pid {self.server.pid} -> {server.pid}", server.started)
        self.server = server
        self._seen = {"request": 0, "cache": 0}

    # ------------------------------------------------------------------ views

    @property
    def lineage(self) -> LineageInfo | None:
        """The running cache; None before the first poll and before the first request."""
        return self.status.lineage if self.status is not None else None

    @property
    def budgets(self) -> Budgets | None:
        """The running cache's budgets (None until it runs: the dashboard shows no configured ones)."""
        return self.lineage.budgets if self.lineage is not None else None

    @property
    def stats(self) -> dict[str, int]:
        return self.lineage.stats if self.lineage is not None else {}

    @property
    def hits(self) -> Hits:
        """The server's hit summary (``/admin/status``'s ``hits``)."""
        return hits_of(self.status)

    @property
    def idle(self) -> Idle | None:
        return self.status.idle if self.status is not None else None

    @property
    def pool(self) -> Pool | None:
        return self.status.pool if self.status is not None else None

    def anchors(self) -> list[EntryInfo]:
        return [e for e in self.entries if e.is_anchor]

    def entry(self, entry_id: str) -> EntryInfo | None:
        return next((e for e in self.entries if e.id == entry_id), None)

    def successor(self, entry_id: str) -> str | None:
        """The entry that absorbed ``entry_id`` (its conversation's longer entry), following a
        chain of absorptions to the one held now; None when it was not absorbed."""
        into, seen = None, {entry_id}
        while (following := self._absorbed_into(into or entry_id)) is not None and following not in seen:
            into = following
            seen.add(into)
            if self.entry(into) is not None:
                break
        return into

    def _absorbed_into(self, entry_id: str) -> str | None:
        for keyed in reversed(self.cache_events):
            event = keyed.data
            if event.get("event") == "absorb" and event.get("entry_id") == entry_id:
                detail = str(event.get("detail") or "")
                return detail[len("into "):] if detail.startswith("into ") else None
        return None

    def where_gone(self, entry_id: str) -> str:
        """Why ``entry_id`` is not held, as the event stream said: absorbed or evicted."""
        into = self.successor(entry_id)
        if into is not None:
            return f"{entry_id} was absorbed into {into} (its conversation's longer entry)"
        if any(k.data.get("event") == "evict" and k.data.get("entry_id") == entry_id for k in self.cache_events):
            return f"{entry_id} was evicted"
        return f"{entry_id} is no longer held"


# ---------------------------------------------------------------------- request metrics


def reuse_fraction(record: dict[str, Any]) -> float:
    """Share of the prompt restored from the cache instead of prefilled."""
    prompt = record.get("prompt_tokens") or 0
    return (record.get("restored_tokens") or 0) / prompt if prompt else 0.0


def hit_ratio(records: Iterable[dict[str, Any]]) -> float | None:
    """Share of requests that restored anything."""
    flags = [bool(r.get("restored_tokens")) for r in records]
    return sum(flags) / len(flags) if flags else None


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile; ``None`` for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]
