"""The shared disk tier: this server reads its peers' files, read-only (issue 38).

Servers of one fleet share one directory (``APC_SHARED_DISK_PATH``): each writes its own
subdirectory of it (its ``APC_LINEAGE_DISK_PATH``, under its own lock, exactly as alone) and
reads every other subdirectory as a *peer*. Nothing here writes, renames or deletes a peer's
file: a file that fails a check is only forgotten here (its owner decides about it).

Why a foreign file is as safe to load as our own: it is found only in the peer's subdirectory
for this model's fingerprint, its header must match our fingerprint, software identity and
layout (``integrity.check_identity``), its header digest is checked when it is indexed and both
digests when it loads; a namespace (API key, tenant, ``cache_salt``) restores only files whose
header names that namespace, as on one server. A peer directory (or its fingerprint directory)
that is not a plain directory of this user's, or that others may write to, is refused: another
user could plant files in it.

What we rely on from the filesystem (docs/design.md, "The shared disk tier"): a file appears
under its final name only by ``rename`` of a complete, fsynced temp file (temp files, hidden and
marked ``.tmp``, are never read), so a name we list is a whole file or no file; a file deleted
while we read it either reads whole (POSIX keeps an open file's data) or fails to open or read,
and a load that fails for any reason fails closed (the request's next restore point, or a cold
prefill). Directory listings may be stale on a network filesystem: the index is only a hint.

Cost: a background thread rescans every ``APC_SHARED_DISK_SCAN_MS``; a peer directory whose
mtime did not change (and is not within ``SETTLE_S`` of now, the mtime granularity of
NFS/SMB) is not listed again, and a listed file's header is read only when its name, size or
mtime is new. A lookup reads the last snapshot: no I/O, one prefix compare per peer file.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server_patch import clock, settings
from server_patch.disk import retention
from server_patch.disk.integrity import IO, SUFFIX, Expected, InvalidFile, is_temp
from server_patch.disk_paths import SHARED_BITS
from server_patch.disk.space import DiskUnavailable
from server_patch.disk.store import DiskStore
from server_patch.lineage.model import DiskRecord

log = logging.getLogger("server_patch.disk")

SETTLE_S = 2.0  # a directory changed this recently is listed again (coarse mtimes on NFS/SMB)
VANISHED = "vanished"  # a peer's file gone between its listing and its load


@dataclass
class PeerRecord(DiskRecord):
    """A peer's file in this server's index: ``store`` (its ``PeerStore``) loads it."""

    store: Any = None
    peer: str = ""


def refusal(path: Path) -> str | None:
    """Why a peer directory must not be read (None: it may): it must be a real directory (no
    symlink) of this user's that nobody else may write to."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory (a symlink or a file)"
    if info.st_uid != os.getuid():
        return f"owned by uid {info.st_uid}, not this server's user ({os.getuid()})"
    if info.st_mode & SHARED_BITS:
        return f"group- or world-writable (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


class PeerStore(DiskStore):
    """One peer's fingerprint directory, read-only: its index kept by listing diffs."""

    writes_in_background = True

    def __init__(self, root: Path, peer: str, owner: DiskStore) -> None:
        # Not DiskStore.__init__: that creates, chmods and marks its directory; this one is a peer's.
        self.root = root
        self.peer = peer
        self.fingerprint = owner.fingerprint
        self.layout = owner.layout
        self.expected: Expected = owner.expected
        self.rejects = owner.rejects  # counted with our own, by reason
        self._closed = True  # never written
        self._dir_mtime: int | None = None
        self._listed_at = 0.0
        self._files: dict[str, tuple[int, int, PeerRecord | None]] = {}  # name -> (size, mtime_ns, record)
        self._lock = threading.Lock()
        self.header_reads = 0

    def scan(self, now: float) -> None:
        """List the directory again if it changed; read the headers of new or changed files."""
        try:
            mtime = os.stat(self.root).st_mtime_ns
        except OSError:
            with self._lock:
                self._files.clear()
            self._dir_mtime = None
            return
        if mtime == self._dir_mtime and now - mtime / 1e9 > SETTLE_S and now - self._listed_at < 60:
            return
        listed: dict[str, tuple[int, int]] = {}
        try:
            with os.scandir(self.root) as it:
                for item in it:
                    if not item.name.endswith(SUFFIX) or is_temp(Path(item.name)) or item.name.startswith("."):
                        continue  # a write in flight, or not a lineage file
                    try:
                        info = item.stat(follow_symlinks=False)
                    except OSError:
                        continue  # deleted since the listing
                    if stat.S_ISREG(info.st_mode):
                        listed[item.name] = (info.st_size, info.st_mtime_ns)
        except OSError as exc:
            log.warning("lineage shared disk: cannot list %s: %s", self.root, exc)
            return
        files = {}
        for name, (size, mtime_ns) in listed.items():
            known = self._files.get(name)
            if known is not None and known[:2] == (size, mtime_ns):
                files[name] = known
                continue
            files[name] = (size, mtime_ns, self._index(self.root / name))
        with self._lock:
            self._files = files
        self._dir_mtime, self._listed_at = mtime, now

    def _index(self, path: Path) -> PeerRecord | None:
        self.header_reads += 1
        try:
            found = self._record_from_header(path)
        except (InvalidFile, OSError, ValueError) as exc:
            log.info("lineage shared disk: peer file %s/%s not indexed: %s", self.peer, path.name, exc)
            return None
        return PeerRecord(**{f: getattr(found, f) for f in found.__dataclass_fields__}, store=self, peer=self.peer)

    def records(self) -> list[PeerRecord]:
        with self._lock:
            return [record for _, _, record in self._files.values() if record is not None]

    def forget(self, record_id: str) -> None:
        with self._lock:
            self._files.pop(f"{record_id}{SUFFIX}", None)

    def load_checked(self, record: DiskRecord) -> tuple[Any, str]:
        """The validated entry, or None and why; a failure forgets the file here, never removes it."""
        path = self.path_of(record.id)
        try:
            return self._load(path, record), ""
        except FileNotFoundError:
            reason, detail = VANISHED, "removed by its server"
        except InvalidFile as exc:
            reason, detail = exc.reason, exc.detail
        except OSError as exc:
            reason, detail = IO, str(exc)
        except Exception as exc:  # never trusted, as our own
            reason, detail = "header", f"{type(exc).__name__}: {exc}"
        self.forget(record.id)
        self.rejects[f"peer_{reason}"] += 1
        log.warning("lineage shared disk: peer file %s/%s not restored (%s: %s); the request restores "
                    "from its next point or prefills cold", self.peer, path.name, reason, detail)
        return None, reason

    def write(self, entry: Any, done: Any) -> None:
        raise DiskUnavailable(f"{self.root} is a peer's directory: read-only")

    def delete(self, record_id: str) -> None:
        """A peer's file is its server's: only forgotten here."""
        self.forget(record_id)


class PeerIndex:
    """Every peer of one store, rescanned on a thread of its own; ``records`` never does I/O."""

    def __init__(self, shared: Path, owner: DiskStore, interval_s: float, retention_s: float = 0.0) -> None:
        self.shared = shared
        self.owner = owner
        self.own_server_dir = owner.root.parent.resolve()
        self.subdir = owner.root.name  # the fingerprint directory: the same model only
        self.interval_s = interval_s
        self.retention_s = retention_s  # a server gone this long: its files are collected (``retention``)
        self._peers: dict[str, PeerStore] = {}
        self.refused: dict[str, str] = {}
        self._snapshot: tuple[PeerRecord, ...] = ()
        self.scans = 0
        self.scan_ms = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "PeerIndex":
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="apc-shared-disk-scan", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception as exc:  # a scan must never end the thread
                log.warning("lineage shared disk: scan of %s failed: %s", self.shared, exc)

    def refresh(self) -> None:
        began = time.perf_counter()
        now = clock.wall()
        seen: dict[str, PeerStore] = {}
        refused: dict[str, str] = {}
        try:
            names = sorted(e.name for e in os.scandir(self.shared) if not e.name.startswith("."))
        except OSError as exc:
            names = []
            refused[str(self.shared)] = f"unreadable: {exc.strerror or exc}"
        for name in names:
            server_dir = self.shared / name
            if _same(server_dir, self.own_server_dir):
                continue
            peer_dir = server_dir / self.subdir
            why = refusal(server_dir)
            if why is None and not os.path.lexists(peer_dir):
                continue  # a peer without files for this model (yet)
            why = why or refusal(peer_dir)
            if why is not None:
                refused[name] = why
                if self.refused.get(name) != why:
                    log.warning("lineage shared disk: peer directory %s refused: %s", server_dir, why)
                continue
            if self.retention_s > 0 and retention.collect(server_dir, peer_dir, now - self.retention_s):
                continue  # a removed server's files, past the retention: gone
            store = self._peers.get(name) or PeerStore(peer_dir, name, self.owner)
            store.scan(now)
            seen[name] = store
        self._peers, self.refused = seen, refused
        self._snapshot = tuple(r for store in seen.values() for r in store.records())
        self.scans += 1
        self.scan_ms = (time.perf_counter() - began) * 1000

    def records(self) -> tuple[PeerRecord, ...]:
        """The last scan's peer files, minus those forgotten since (a failed load)."""
        return tuple(r for r in self._snapshot if f"{r.id}{SUFFIX}" in r.store._files)

    def health(self) -> dict[str, Any]:
        return {"path": str(self.shared), "scans": self.scans, "scan_ms": round(self.scan_ms, 3),
                "files": {name: len(store.records()) for name, store in self._peers.items()},
                "header_reads": sum(s.header_reads for s in self._peers.values()),
                "refused": dict(self.refused)}

    def close(self) -> None:
        self._stop.set()


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b
    except OSError:
        return False


def shared_path(env: Any = None) -> Path | None:
    value = settings.value("APC_SHARED_DISK_PATH", env)
    return Path(value).expanduser() if value is not None else None


def attach(store: DiskStore) -> PeerIndex | None:
    """Start reading the peers of ``store`` when a shared directory is configured."""
    shared = shared_path()
    if shared is None:
        return None
    interval = max(0.05, settings.value("APC_SHARED_DISK_SCAN_MS") / 1000)
    index = PeerIndex(shared, store, interval, settings.value("APC_SHARED_DISK_RETENTION_S")).start()
    log.info("lineage shared disk: reading peers under %s (%d files, refused: %s)", shared,
             len(index.records()), index.refused or "none")
    return index

