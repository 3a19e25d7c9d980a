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
from typing import Any, Callable, Protocol

from apcctl.core.client import AdminClient, AdminError
from apcctl.core.hosts import is_local_url
from apcctl.core.process import ProcessInfo, ProcessSampler

Emit = Callable[[str, dict[str, Any]], None]


class SourceError(RuntimeError):
    """The source cannot answer now (server down, restarting, wrong token); ``status`` as AdminError's."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Snapshot:
    """One poll: ``/admin/status``, ``/admin/entries`` and the process, taken at ``taken`` (source clock)."""

    status: dict[str, Any]
    entries: list[dict[str, Any]]
    process: ProcessInfo | None
    taken: float


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

    def pin(self, entry_id: str) -> dict[str, Any]: ...

    def unpin(self, entry_id: str) -> dict[str, Any]: ...

    def evict(self, entry_id: str) -> dict[str, Any]: ...

    def new_anchor(self, system: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]: ...


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
            entries = self.client.entries() if status.get("lineage") is not None else []
        except AdminError as exc:
            raise _source_error(exc) from None
        pid = (status.get("server") or {}).get("pid")
        process = self._sampler.sample(pid) if self._sampler is not None else None
        return Snapshot(status, entries, process, time.time())

    def follow(self, emit: Emit, stop: threading.Event) -> None:
        try:
            server = self.client.status()["server"]
            emit("hello", {"pid": server.get("pid"), "started": server.get("started")})
            for name, data in self.client.events(since=0, timeout=self.stream_timeout, stop=stop):
                emit(name, data)
        except AdminError as exc:
            raise _source_error(exc) from None
        except (OSError, ValueError) as exc:  # the connection dropped mid-stream
            raise SourceError(f"event stream broke: {exc}") from None

    def _call(self, verb: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
        try:
            return verb(*args)
        except AdminError as exc:
            raise _source_error(exc) from None

    def pin(self, entry_id: str) -> dict[str, Any]:
        return self._call(self.client.pin, entry_id)

    def unpin(self, entry_id: str) -> dict[str, Any]:
        return self._call(self.client.unpin, entry_id)

    def evict(self, entry_id: str) -> dict[str, Any]:
        return self._call(self.client.evict, entry_id)

    def new_anchor(self, system: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self._call(self.client.new_anchor, system, tools)
