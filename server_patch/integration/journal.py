"""A week of traffic on disk: every request record and cache event as one JSON line.

The ring buffers behind ``/admin/requests`` and ``/admin/events`` forget on restart; the
journal does not. It is a size-capped set of rotating files in the server's state directory
(``journal.jsonl`` is the newest, ``journal.jsonl.1`` the one before, ...), read back by
``apcctl report``. Each line is flushed to the OS as it is written, so a restart (even a
SIGKILL) loses at most a torn last line, which the reader skips. Lines hold users' token
ids, and a request line's ``drift`` a short decoded text diff (``server_patch.drift``;
``APC_DRIFT_TEXT=0``: none), so the files are 0600 in a 0700 directory whatever the umask.

Lines by ``type``: ``start`` (a server start), ``request`` (a request's record, once: at its
first token, or when it was cancelled before one), ``request_outcome`` (the final outcome of a
request whose ``request`` line came earlier: cancelled in decode; it names that line by its
``seq``, which restarts at 1 after each ``start``), ``cache`` (a cache event), ``budgets`` and
``blocks``: each sequence the cache processed (a prompt at its lookup, a prompt and its fed
reply when its entry moved past it) as the live oracle's block hashes (``lineage.shadow``: 8
bytes per 16 tokens, base64, no token text; delta-encoded, ``block_lines``), which ``apcctl
report --what-if`` replays. The
``start`` line carries the lineage settings in force.

Settings (environment, ``server_patch.settings``): ``APC_JOURNAL=0`` turns it off;
``APC_JOURNAL_DIR`` (default ``<state dir>/journal``); ``APC_JOURNAL_MAX_BYTES`` per file (64M;
a size such as ``64M`` or ``1GiB``); ``APC_JOURNAL_FILES`` kept in all (8);
``APC_JOURNAL_SNAPSHOT_S``, the least time between two budget snapshots (60).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Mapping, TypeVar

import numpy as np

from server_patch import clock, settings
from server_patch.disk_paths import is_shared
from server_patch.integration import shadow_warmup
from server_patch.integration.block_lines import BlockEncoder
from server_patch.private_files import open_private, private_dir
from server_patch.paths import state_dir

L = TypeVar("L")  # a listener

if TYPE_CHECKING:
    from server_patch.integration.runtime import LineageRuntime
    from server_patch.integration.timings import RequestTiming
    from server_patch.lineage import Event

log = logging.getLogger("server_patch.lineage")

FILE_NAME = "journal.jsonl"
MAX_BYTES = settings.setting("APC_JOURNAL_MAX_BYTES").default  # per file
FILES = settings.setting("APC_JOURNAL_FILES").default  # the live file and seven rotated ones
SNAPSHOT_S = settings.setting("APC_JOURNAL_SNAPSHOT_S").default  # budgets are sampled at most this often


def journal_files(directory: Path) -> list[Path]:
    """The journal's files, oldest first (``journal.jsonl.7`` ... ``journal.jsonl``)."""
    rotated = []
    for path in directory.glob(FILE_NAME + ".*"):
        suffix = path.name[len(FILE_NAME) + 1:]
        if suffix.isdigit():
            rotated.append((int(suffix), path))
    live = directory / FILE_NAME
    return [p for _, p in sorted(rotated, reverse=True)] + ([live] if live.exists() else [])


class Journal:
    """A thread-safe appender of JSON lines with a size cap and numbered rotation."""

    def __init__(self, directory: Path, *, max_bytes: int = MAX_BYTES, files: int = FILES) -> None:
        if max_bytes < 1024 or files < 1:
            raise ValueError("journal needs max_bytes >= 1024 and files >= 1")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.files = files
        self._lock = threading.Lock()
        # The journal's own directory is made owner-only, but a shared one (APC_JOURNAL_DIR=/tmp) keeps
        # its mode: the server never changes a directory others use; the files are 0600 either way.
        private_dir(self.directory, tighten=not is_shared(self.directory))
        for older in journal_files(self.directory):  # files an earlier version left readable
            try:
                os.chmod(older, 0o600)
            except OSError:
                pass
        self._file: IO[bytes] | None = None
        self._size = 0
        self._open()

    @property
    def path(self) -> Path:
        return self.directory / FILE_NAME

    def _open(self) -> None:
        fd = open_private(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._file = os.fdopen(fd, "ab")
        self._size = self._file.seek(0, os.SEEK_END)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record as a line; rotate first if it would not fit in the live file."""
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            if self._file is None:
                return
            if self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            self._file.write(line)
            self._file.flush()
            self._size += len(line)

    def _rotate(self) -> None:
        """journal.jsonl -> .1 -> .2 ...; the oldest beyond ``files`` is deleted."""
        assert self._file is not None
        self._file.close()
        oldest = self.directory / f"{FILE_NAME}.{self.files - 1}"
        if self.files == 1:
            self.path.unlink(missing_ok=True)
        else:
            oldest.unlink(missing_ok=True)
            for n in range(self.files - 2, 0, -1):
                src = self.directory / f"{FILE_NAME}.{n}"
                if src.exists():
                    os.replace(src, self.directory / f"{FILE_NAME}.{n + 1}")
            os.replace(self.path, self.directory / f"{FILE_NAME}.1")
        self._open()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return bool(settings.value("APC_JOURNAL", environ))


def directory_from_env(environ: Mapping[str, str] | None = None) -> Path:
    """``APC_JOURNAL_DIR``, else ``<state dir>/journal`` (``apcctl report`` reads the same)."""
    return Path(settings.value("APC_JOURNAL_DIR", environ) or state_dir() / "journal").expanduser()


def from_env(environ: Mapping[str, str] | None = None) -> Journal | None:
    """The journal the environment asks for, or None when it is off."""
    if not enabled(environ):
        return None
    return Journal(directory_from_env(environ), max_bytes=settings.value("APC_JOURNAL_MAX_BYTES", environ),
                   files=settings.value("APC_JOURNAL_FILES", environ))


class JournalRecorder:
    """Turns a runtime's request records and cache events into journal lines."""

    def __init__(self, journal: Journal, runtime: LineageRuntime, snapshot_s: float = SNAPSHOT_S) -> None:
        self.journal = journal
        self.runtime = runtime
        self.snapshot_s = snapshot_s
        self._last_snapshot = float("-inf")
        self._blocks = BlockEncoder()
        self.start_line: tuple[int, float] | None = None

    def started(self) -> None:
        config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self.runtime.config).items()}
        self.start_line = (os.getpid(), clock.wall())  # this run's start line (the warm-up stops there)
        self.journal.append({"type": "start", "time": self.start_line[1], "pid": self.start_line[0],
                             "fingerprint": self.runtime.fingerprint, "lineage_config": config})
        self.snapshot(force=True)

    def on_event(self, seq: int, at: float, event: Event) -> None:
        # Called with the cache's (reentrant) lock held by this thread, so budgets() is safe here.
        from server_patch.admin.views import event_view

        self.journal.append(event_view(seq, at, event))
        self.snapshot()

    def on_request(self, record: RequestTiming) -> None:
        self.journal.append({"type": "request", "time": clock.wall(), **record.as_dict()})
        self.snapshot()

    def on_blocks(self, namespace: str, hashes: np.ndarray, tokens: int, kind: str) -> None:
        """A processed sequence's block hashes (``lineage.misses``'s listener), delta-encoded
        against a recent line (``block_lines``)."""
        self.journal.append({"type": "blocks", "time": clock.wall(), "kind": kind, "namespace": namespace,
                             "tokens": tokens, "block": self.runtime.cache.misses.shadow.block,
                             **self._blocks.fields(namespace, hashes)})

    def on_outcome(self, record: RequestTiming) -> None:
        """A request journaled at its first token ended otherwise (cancelled in decode)."""
        self.journal.append({"type": "request_outcome", "time": clock.wall(), "seq": record.seq,
                             "request_id": record.request_id, "outcome": record.outcome,
                             "phase": record.phase, "stored": record.stored,
                             "reply_tokens": record.reply_tokens})

    def close(self) -> None:
        """Stop recording (the runtime is closed: its model was unloaded) and close the file."""
        timings = self.runtime.timings
        _unlisten(self.runtime.event_listeners, self.on_event)
        _unlisten(timings.listeners, self.on_request)
        _unlisten(timings.outcome_listeners, self.on_outcome)
        _unlisten(self.runtime.cache.misses.listeners, self.on_blocks)
        self.journal.close()

    def snapshot(self, force: bool = False) -> None:
        """Bytes per tier now, so a report can draw them over time; rate-limited."""
        now = clock.monotonic()  # the rate limit is an interval; the record's time is for display
        if not force and now - self._last_snapshot < self.snapshot_s:
            return
        self._last_snapshot = now
        self.journal.append({"type": "budgets", "time": clock.wall(), **self.runtime.cache.budgets()})


def _unlisten(listeners: list[L], listener: L) -> None:
    if listener in listeners:
        listeners.remove(listener)


def attach(runtime: LineageRuntime) -> JournalRecorder | None:
    """Register the journal on ``runtime``'s listeners; a journal that cannot open only warns."""
    try:
        journal = from_env()
    except (OSError, ValueError) as exc:
        log.warning("apc_lineage journal disabled: %s", exc)
        return None
    if journal is None:
        return None
    recorder = JournalRecorder(journal, runtime, snapshot_s=settings.value("APC_JOURNAL_SNAPSHOT_S"))
    runtime.event_listeners.append(recorder.on_event)
    runtime.timings.listeners.append(recorder.on_request)
    runtime.timings.outcome_listeners.append(recorder.on_outcome)
    runtime.cache.misses.listeners.append(recorder.on_blocks)
    recorder.started()
    assert recorder.start_line is not None  # ``started`` wrote it
    log.info("apc_lineage journal %s", journal.path)
    # The live oracle's shadow, from earlier runs of this model (``shadow_warmup``).
    shadow_warmup.start(runtime.cache.misses, journal_files(journal.directory), runtime.fingerprint,
                        recorder.start_line)
    return recorder
