"""Where the dashboard's data comes from: a protocol, and the live implementation over the admin client.

The app never talks HTTP itself. It asks a ``DashboardSource`` for snapshots (status and
entries, polled) and for a stream of events (requests and cache events, pushed), and sends the
operator's verbs through it. ``LiveSource`` does that over ``apcctl.core.client.AdminClient``,
and samples a local server's process with ``apcctl.core.process``; the recorded source in
``tui.recorded`` does it from a JSON file, so snapshot tests and offline demos see exactly the
same screens.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from apcctl.core.client import AdminClient, AdminError
from apcctl.core.hosts import is_local_url
from apcctl.core.process import ProcessInfo, ProcessSampler

if TYPE_CHECKING:
    from server_patch.admin.schema import EntryInfo, Evicted, NewAnchor, Status

Emit = Callable[[str, dict[str, Any]], None]


class SourceError(RuntimeError):
    """The source cannot answer now (server down, restarting, wrong token); ``status`` as AdminError's."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Snapshot:
    """One poll: ``/admin/status``, ``/admin/entries`` and the process, taken at ``taken`` (source clock).

    Typed (``server_patch.admin.schema``); given as JSON (a recording) they are parsed here.
    """

    status: Status
    entries: list[EntryInfo]
    process: ProcessInfo | None
    taken: float

    def __post_init__(self) -> None:
        from server_patch.admin.schema import EntryInfo, Status

        object.__setattr__(self, "status", Status.of(self.status))
        object.__setattr__(self, "entries", [EntryInfo.of(e) for e in self.entries])


class DashboardSource(Protocol):
    """What the dashboard needs from a server. Every call may block; the app calls them from threads."""

    name: str  # how the header names the server (its URL, or the recording's file name)

    def now(self) -> float:
        """The clock ages are measured against (wall clock live, the recording's clock in replays)."""
        ...

    def snapshot(self) -> Snapshot:
        """Status, entries and process now; raises ``SourceError`` when the server cannot answer."""
        ...

    def follow(self, emit: Emit, stop: threading.Event) -> None:
        """Call ``emit(name, data)`` for each event until ``stop`` is set or the stream ends.

        The first event of every connection is ``("hello", {"pid", "started"})`` so the app can
        tell a reconnect to the same server from a restarted one. Raises ``SourceError``.
        """
        ...

    def pin(self, entry_id: str) -> EntryInfo: ...

    def unpin(self, entry_id: str) -> EntryInfo: ...

    def evict(self, entry_id: str) -> Evicted: ...

    def new_anchor(self, system: str, tools: list[dict[str, Any]] | None = None) -> NewAnchor: ...


def _source_error(exc: AdminError) -> SourceError:
    return SourceError(exc.message, exc.status)


class LiveSource:
    """A running patched server, through the shared admin client."""

    def __init__(self, client: AdminClient, *, stream_timeout: float = 10.0) -> None:
        self.client = client
        self.name = client.base_url.rstrip("/")
        self.stream_timeout = stream_timeout
        self._sampler = ProcessSampler() if is_local_url(client.base_url) else None

    def now(self) -> float:
        return time.time()

    def snapshot(self) -> Snapshot:
        try:
            status = self.client.status()
            # Before the first request there is no lineage cache: no entries to list.
            entries = self.client.entries() if status.started else []
        except AdminError as exc:
            raise _source_error(exc) from None
        process = self._sampler.sample(status.server.pid) if self._sampler is not None else None
        return Snapshot(status, entries, process, time.time())

    def follow(self, emit: Emit, stop: threading.Event) -> None:
        try:
            server = self.client.status().server
            emit("hello", {"pid": server.pid, "started": server.started})
            for name, data in self.client.events(since=0, timeout=self.stream_timeout, stop=stop):
                emit(name, data)
        except AdminError as exc:
            raise _source_error(exc) from None
        except (OSError, ValueError) as exc:  # the connection dropped mid-stream
            raise SourceError(f"event stream broke: {exc}") from None

    def _call(self, verb: Callable[..., Any], *args: Any) -> Any:
        try:
            return verb(*args)
        except AdminError as exc:
            raise _source_error(exc) from None

    def pin(self, entry_id: str) -> EntryInfo:
        return self._call(self.client.pin, entry_id)

    def unpin(self, entry_id: str) -> EntryInfo:
        return self._call(self.client.unpin, entry_id)

    def evict(self, entry_id: str) -> Evicted:
        return self._call(self.client.evict, entry_id)

    def new_anchor(self, system: str, tools: list[dict[str, Any]] | None = None) -> NewAnchor:
        return self._call(self.client.new_anchor, system, tools)
