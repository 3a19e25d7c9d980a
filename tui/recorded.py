"""A recorded server: the same screens as live, from a JSON file, so snapshots are deterministic.

A recording is one poll (status, entries, process) plus the events the stream had delivered,
and the clock they were taken at. ``record()`` captures one from a live server. The recorded
source also answers the operator's verbs (pin, unpin, evict, new anchor) on its copy, and
``push()`` adds events after the replay, so pilot tests can drive the app without a server.

    python -m tui.recorded http://127.0.0.1:8080 TOKEN out.json   # capture a recording
"""

from __future__ import annotations

import copy
import json
import queue
import sys
import threading
from pathlib import Path
from typing import Any

from apcctl.core.client import AdminClient
from apcctl.core.process import ProcessInfo
from server_patch.admin.schema import EntryInfo, Evicted, NewAnchor
from tui.source import Emit, LiveSource, Snapshot, SourceError


class RecordedSource:
    """Replays a recording; every verb changes its private copy and is listed in ``calls``."""

    def __init__(self, recording: dict[str, Any], name: str = "recording") -> None:
        self.recording = copy.deepcopy(recording)
        self.name = name
        self.calls: list[tuple[str, Any]] = []
        self.replayed = threading.Event()  # set once every recorded event was emitted
        self.failing: str | None = None  # set to make every call fail (a server that went away)
        self._pushed: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()

    @classmethod
    def load(cls, path: Path | str) -> "RecordedSource":
        path = Path(path)
        return cls(json.loads(path.read_text(encoding="utf-8")), name=path.name)

    # ------------------------------------------------------------------ reads

    def now(self) -> float:
        return float(self.recording["now"])

    def snapshot(self) -> Snapshot:
        self._check()
        process = self.recording.get("process")
        return Snapshot(copy.deepcopy(self.recording["status"]), copy.deepcopy(self.recording["entries"]),
                        ProcessInfo(**process) if process else None, self.now())

    def follow(self, emit: Emit, stop: threading.Event) -> None:
        self._check()
        server = self.recording["status"]["server"]
        emit("hello", {"pid": server.get("pid"), "started": server.get("started")})
        for name, data in self.recording.get("events", []):
            emit(name, copy.deepcopy(data))
        self.replayed.set()
        while not stop.is_set():
            try:
                name, data = self._pushed.get(timeout=0.05)
            except queue.Empty:
                continue
            emit(name, data)

    def push(self, name: str, data: dict[str, Any]) -> None:
        """Deliver one more event after the replay, as if the server had just sent it."""
        self._pushed.put((name, data))

    def _check(self) -> None:
        if self.failing is not None:
            raise SourceError(self.failing)

    # ------------------------------------------------------------------ verbs

    def _find(self, entry_id: str) -> dict[str, Any]:
        found = next((e for e in self.recording["entries"] if e["id"] == entry_id), None)
        if found is None:
            raise SourceError(f"HTTP 404: no entry {entry_id!r}", 404)
        return found

    def pin(self, entry_id: str) -> EntryInfo:
        self._check()
        self.calls.append(("pin", entry_id))
        entry = self._find(entry_id)
        entry.update(pinned=True, kind="anchor")
        return EntryInfo.from_json(copy.deepcopy(entry))

    def unpin(self, entry_id: str) -> EntryInfo:
        self._check()
        self.calls.append(("unpin", entry_id))
        entry = self._find(entry_id)
        entry["pinned"] = False
        return EntryInfo.from_json(copy.deepcopy(entry))

    def evict(self, entry_id: str) -> Evicted:
        self._check()
        self.calls.append(("evict", entry_id))
        entry = self._find(entry_id)
        self.recording["entries"].remove(entry)
        return Evicted(evicted=entry_id, freed_bytes=(entry.get("bytes") or 0) + (entry.get("disk_bytes") or 0))

    def new_anchor(self, system: str, tools: list[dict[str, Any]] | None = None) -> NewAnchor:
        self._check()
        self.calls.append(("new_anchor", {"system": system, "tools": tools}))
        entry = {"id": f"rec{len(self.calls):09d}", "kind": "anchor", "pinned": True, "length": len(system) // 4,
                 "bytes": 0, "kv_bytes": 0, "checkpoint_bytes": 0, "created": self.now(), "last_used": self.now(),
                 "last_hit": None, "hits": 0, "tier": "ram", "disk_bytes": 0, "label": system[:80],
                 "namespace": "0", "checkpoints": []}
        self.recording["entries"].append(entry)
        return NewAnchor(anchor=EntryInfo.from_json(copy.deepcopy(entry)), created=True)


def record(client: AdminClient, seconds: float = 2.0) -> dict[str, Any]:
    """One poll and ``seconds`` of the event stream (which replays the server's ring first)."""
    source = LiveSource(client)
    snapshot = source.snapshot()
    events: list[tuple[str, dict[str, Any]]] = []
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    try:
        source.follow(lambda name, data: events.append((name, data)) if name != "hello" else None, stop)
    finally:
        timer.cancel()
    process = snapshot.process
    return {"now": snapshot.taken, "status": snapshot.status.to_json(), "entries": [e.to_json() for e in snapshot.entries],
            "process": None if process is None else vars(process), "events": events}


if __name__ == "__main__":
    url, token, out = sys.argv[1:4]
    Path(out).write_text(json.dumps(record(AdminClient(url, token)), indent=1) + "\n", encoding="utf-8")
