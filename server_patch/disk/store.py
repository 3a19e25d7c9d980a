"""The disk tier: one safetensors file per lineage entry, written atomically in the background.

A file holds the entry's KV rows once, its head snapshot, and each checkpoint's snapshot. The
header carries the format, the model fingerprint (config, weights, KV dtype, software versions),
the versions themselves, the cache layout, token ids, checkpoint lengths and two digests
(``integrity``), so the index is rebuilt at start from headers alone. Nothing from a file is
trusted until its digests match: a file that fails any check is removed, counted in
``rejects`` by reason, and the request prefills cold.

Writes are stalled neither by a full disk nor by a failing one: ``space.WriteGuard`` keeps a
free-space floor and backs off after a failure, and ``write`` then fails at once (the policy
keeps the entry dirty and counts it). ``write`` runs on the generation thread and does no I/O:
the writer thread reads the free space, before and after each file.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

import mlx.core as mx
import numpy as np

from server_patch import clock
from server_patch.disk import faults
from server_patch.disk.marker import mark
from server_patch.private_files import create_private, fsync_dir, fsync_fd, private_dir
from server_patch.disk.integrity import (
    ARRAY, FORMAT, HASH_HEX, HEADER, IO, SUFFIX, Expected, InvalidFile, TableRow, build_header,
    check_identity, contents, data_hasher, encode_tokens, is_temp, numpy_buffer, read_header,
    stream_tensors, temp_name, temp_pid,
)
from server_patch.disk.space import DiskUnavailable, WriteGuard, min_free_from_env
from server_patch.infra.workers import Worker
from server_patch.lineage.model import Checkpoint, DiskRecord, Entry
from server_patch.state.fingerprint import software_identity
from server_patch.state.layout import CacheLayout, MlxKV, MlxSnapshot

log = logging.getLogger("server_patch.disk")

__all__ = ["DiskStore", "FORMAT", "InvalidFile"]

_CODE = {mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.int16: "I16",
         mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32", mx.int32: "I32",
         mx.float32: "F32", mx.uint64: "U64", mx.int64: "I64", mx.complex64: "C64"}
if hasattr(mx, "float64"):
    _CODE[mx.float64] = "F64"
_DTYPE = {code: dtype for dtype, code in _CODE.items()}


def _flatten(prefix: str, layers: list[list[dict]], tensors: dict[str, mx.array]) -> list:
    """Arrays into ``tensors``; everything else (and array placeholders) into the returned meta."""
    meta = []
    for li, layer in enumerate(layers):
        layer_meta = []
        for ci, child in enumerate(layer):
            child_meta: dict[str, Any] = {}
            for key, value in child.items():
                if isinstance(value, mx.array):
                    tensors[f"{prefix}.{li}.{ci}.{key}"] = value
                    child_meta[key] = ARRAY
                else:
                    child_meta[key] = value
            layer_meta.append(child_meta)
        meta.append(layer_meta)
    return meta


def _unflatten(prefix: str, meta: list, tensors: dict[str, mx.array]) -> list[list[dict]]:
    # integrity.contents checked that every placeholder names a tensor of the file.
    return [[{key: tensors[f"{prefix}.{li}.{ci}.{key}"] if value == ARRAY else value
              for key, value in child_meta.items()}
             for ci, child_meta in enumerate(layer_meta)]
            for li, layer_meta in enumerate(meta)]


def _as_bytes(array: mx.array) -> memoryview:
    """The array's bytes, C order (a contiguous copy only if it is a strided view)."""
    flat = array.reshape(-1).view(mx.uint8) if array.size else mx.zeros((0,), mx.uint8)
    mx.eval(flat)
    return memoryview(flat)


def _mlx_buffer(nbytes: int) -> tuple[mx.array | np.ndarray, memoryview]:
    """A fresh, evaluated MLX byte array and a writable view of its memory (MLX documents
    ``np.array(a, copy=False)`` as sharing it): the file is read straight into the array that
    will hold the tensor, with no second copy (``mx.array(numpy)`` costs one, and 4x the time).
    Where MLX does not share a plain buffer, a numpy one (converted by ``_as_mlx``)."""
    owner = mx.zeros((nbytes,), mx.uint8)
    mx.eval(owner)
    view = np.array(owner, copy=False)
    if view.flags.writeable and view.strides == (1,):
        return owner, memoryview(view)
    return numpy_buffer(nbytes)


def _as_mlx(raw: mx.array | np.ndarray) -> mx.array:
    return raw if isinstance(raw, mx.array) else mx.array(raw)


WRITER_THREAD = "apc-lineage-disk"


def own_stream() -> None:
    """A worker thread's MLX stream, its own, on the CPU (MLX streams are per thread; made once
    per thread by ``infra.workers``, which reuses the thread for the next runtime's writer)."""
    mx.set_default_stream(mx.new_stream(mx.cpu))


def new_writer(workers: Any = None) -> Worker:
    """A disk writer: one worker thread that runs a store's queued writes, built by ``workers``
    (a runtime's ``infra.workers.Workers``, which closes it with the runtime) or on its own."""
    return workers.worker(WRITER_THREAD, setup=own_stream) if workers is not None else \
        Worker(WRITER_THREAD, setup=own_stream)


class DiskStore:
    """The policy's ``DiskTier`` over a directory, written by its writer (``new_writer``): the
    runtime's, handed in, or one of its own that ``close`` closes."""

    # ``write`` only queues: the policy never waits for a file, it frees RAM at once (``budget``).
    writes_in_background = True
    peers: Any = None  # the shared tier's ``peers.PeerIndex`` (issue 38), when configured

    def __init__(self, root: Path | str, *, fingerprint: str, layout: CacheLayout,
                 min_free: float | None = None, writer: Any = None) -> None:
        self.root = private_dir(Path(root))
        mark(self.root.parent)  # the tier: ``apcctl check --fix`` removes files only under a marked one
        self.fingerprint = fingerprint
        self.layout = layout
        self.expected = Expected(identity=software_identity(), fingerprint=fingerprint,
                                 layout=layout.describe())
        self.guard = WriteGuard(self.root, min_free_from_env() if min_free is None else min_free)
        # Files removed because they could not be trusted, by reason (integrity.* constants).
        self.rejects: Counter[str] = Counter()
        self._queue: queue.Queue = queue.Queue()  # this store's writes; its writer runs them
        self._owns_writer = writer is None
        self._writer = new_writer() if writer is None else writer  # ``submit(job)``, ``close(timeout)``
        self._closed = False

    # ------------------------------------------------------------------ index

    def path_of(self, record_id: str) -> Path:
        return self.root / f"{record_id}{SUFFIX}"

    def records(self) -> Iterable[DiskRecord]:
        """Rebuild the index from headers (called once, at start): files that cannot be
        validated are removed, and so are temp files of other processes (a killed one: no live
        one writes here, the server holds the directory lock). Never raises for a file's content."""
        out = []
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            if is_temp(path):
                if temp_pid(path) != os.getpid():
                    _unlink(path, "temp file left by an interrupted write")
                continue
            try:
                out.append(self._record_from_header(path))
            except InvalidFile as exc:
                self._reject(path, exc.reason, exc.detail)
            except OSError as exc:
                self._reject(path, IO, str(exc))
            except Exception as exc:  # a check we did not foresee: still never trusted
                self._reject(path, HEADER, f"{type(exc).__name__}: {exc}")
        return out

    def _record_from_header(self, path: Path) -> DiskRecord:
        header = read_header(path)
        found = contents(header)
        check_identity(header, found, self.expected)
        stat = path.stat()
        return DiskRecord(id=path.name[: -len(SUFFIX)], tokens=found.tokens, namespace=found.namespace,
                          checkpoints=found.checkpoints, nbytes=stat.st_size, last_used=stat.st_mtime,
                          is_anchor=found.is_anchor, pinned=found.pinned, label=found.label)

    def _reject(self, path: Path, reason: str, detail: str) -> str:
        self.rejects[reason] += 1
        log.warning("lineage disk: rejected %s reason=%s: %s (removed; requests prefill cold)",
                    path.name, reason, detail)
        _unlink(path, None)
        return reason

    # ------------------------------------------------------------------ write

    def write(self, entry: Entry, done: Callable[[Entry, DiskRecord | None], None]) -> None:
        """Queue a write; the references taken now are what gets written.

        Raises ``space.DiskUnavailable`` at once while writes back off after a failure or after
        the writer found the volume below the free-space floor: the caller keeps the entry and
        tries later. Runs on the generation thread (a commit's eviction): no I/O here, the free
        space is read by the writer (``space.WriteGuard.admit_queued``).
        """
        if self._closed:
            raise DiskUnavailable(f"the disk store {self.root} is closed (its model was unloaded)")
        self.guard.admit_queued()
        # The handles' arrays were evaluated where they were made (CacheLayout.split): an
        # unevaluated array could only be computed on its creator's thread, and this may be
        # called from the idle ticker or an admin request.
        self._queue.put((entry, entry.kv, entry.head, list(entry.checkpoints), done))
        if not self._writer.submit(self.write_next):  # its runtime closed its workers first
            self._queue.get_nowait()
            self._queue.task_done()
            raise DiskUnavailable(f"the disk store {self.root} has no writer (its runtime was closed)")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write finished; False on timeout."""
        if timeout is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    @property
    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def health(self) -> dict[str, Any]:
        """What an operator needs to see of the tier: rejected files by reason, write attempts,
        failures and the current backoff, and the volume's free space against the floor."""
        try:
            total, _, free = self.guard.usage(self.root)  # what the free-space floor reads
        except OSError:
            total = free = 0
        return {"rejects": dict(self.rejects), "writes": dict(self.guard.stats),
                "backoff_s": self.guard.delay_s, "retry_in_s": self.guard.retry_in(),
                "last_error": self.guard.last_error, "min_free": self.guard.min_free,
                "volume_bytes": total, "free_bytes": free,
                **({"peers": self.peers.health()} if self.peers is not None else {})}

    def write_next(self) -> None:
        """Run this store's oldest queued write (on its writer's thread); none left (dropped at
        close): nothing."""
        try:
            entry, kv, head, checkpoints, done = self._queue.get_nowait()
        except queue.Empty:
            return
        try:
            record = self._write_guarded(entry, kv, head, checkpoints)
        except Exception as exc:  # a failed write must not kill the writer
            log.warning("lineage disk write of %s failed: %s", entry.id, exc)
            record = None
        try:
            done(entry, record)
        finally:
            self._queue.task_done()

    def _write_guarded(self, entry: Entry, kv: MlxKV, head: MlxSnapshot,
                       checkpoints: list[Checkpoint]) -> DiskRecord:
        tensors: dict[str, mx.array] = {}
        meta = self._meta(entry, kv, head, checkpoints, tensors)
        self.guard.admit(sum(int(a.nbytes) for a in tensors.values()))
        self.guard.attempted()
        try:
            record = self._write_now(entry, meta, tensors, checkpoints)
        except OSError as exc:
            self.guard.failed(exc)
            raise
        self.guard.succeeded()
        self.guard.after_write()  # the file took space: a volume now below the floor pauses writes
        return record

    def _meta(self, entry: Entry, kv: MlxKV, head: MlxSnapshot, checkpoints: list[Checkpoint],
              tensors: dict[str, mx.array]) -> dict[str, str]:
        return {
            "fingerprint": self.fingerprint,
            "identity": json.dumps(self.expected.identity, sort_keys=True),
            "layout": self.expected.layout or "",
            "namespace": entry.namespace,
            "length": str(entry.length),
            "tokens": encode_tokens(entry.tokens),
            "is_anchor": "1" if entry.is_anchor else "0",
            "pinned": "1" if entry.pinned else "0",
            "label": entry.label,
            "checkpoints": json.dumps([[c.length, c.kind] for c in checkpoints]),
            # Reply reuse: the protected prompt end (0 unless it is one of these checkpoints)
            # and the reply-end points thinned first.
            "prompt_end": str(entry.prompt_end if any(c.length == entry.prompt_end for c in checkpoints) else 0),
            "reply_ends": json.dumps([c.length for c in checkpoints if c.reply_end]),
            # Rows past the entry (an adopted buffer's spare room) are not state: cut them.
            # Raises while the rows are lent to a running request (the entry stays dirty).
            "kv_meta": json.dumps(_flatten("kv", kv.trimmed_layers(), tensors)),
            "head_meta": json.dumps(_flatten("head", head.layers, tensors)),
            "cp_meta": json.dumps([_flatten(f"cp{i}", c.state.layers, tensors)
                                   for i, c in enumerate(checkpoints)]),
        }

    def _write_now(self, entry: Entry, meta: dict[str, str], tensors: dict[str, mx.array],
                   checkpoints: list[Checkpoint]) -> DiskRecord:
        """Header (placeholder digests), each tensor hashed as it is written, the header again
        with the digests, fsync, rename, fsync of the directory."""
        names = sorted(tensors)
        table = [TableRow(n, _CODE[tensors[n].dtype], tuple(tensors[n].shape), int(tensors[n].nbytes))
                 for n in names]
        placeholder = build_header(meta, table, "0" * HASH_HEX)
        final = self.path_of(entry.id)
        tmp = self.root / temp_name(entry.id, threading.get_ident())
        fd = create_private(tmp)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(placeholder)
                hasher = data_hasher()
                for name in names:
                    data = _as_bytes(tensors[name])
                    hasher.update(data)
                    f.write(data)
                    del data
                sealed = build_header(meta, table, hasher.hexdigest())
                assert len(sealed) == len(placeholder)
                f.seek(0)
                f.write(sealed)
                f.flush()
                faults.during_write()
                fsync_fd(f.fileno())
            os.replace(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            _unlink(tmp, "failed write")
            raise
        stat = final.stat()
        return DiskRecord(id=entry.id, tokens=entry.tokens, namespace=entry.namespace,
                          checkpoints=tuple((c.length, c.kind) for c in checkpoints),
                          nbytes=stat.st_size, last_used=clock.steady(), is_anchor=entry.is_anchor,
                          pinned=entry.pinned, label=entry.label)

    def delete(self, record_id: str) -> None:
        _unlink(self.path_of(record_id), None)

    # ------------------------------------------------------------------ load

    def load(self, record: DiskRecord) -> Entry | None:
        """The validated entry, or None (the file removed, the reason counted) if anything is off."""
        return self.load_checked(record)[0]

    def load_checked(self, record: DiskRecord) -> tuple[Entry | None, str]:
        """``load``, and why a file was rejected: the request flow's ``DiskLoader``."""
        if (peer := getattr(record, "store", None)) is not None and peer is not self:
            return peer.load_checked(record)  # a peer's file (``peers``): read-only, its own rules
        path = self.path_of(record.id)
        try:
            entry = self._load(path, record)
        except InvalidFile as exc:
            return None, self._reject(path, exc.reason, exc.detail)
        except OSError as exc:
            return None, self._reject(path, IO, str(exc))
        except Exception as exc:  # shapes that do not build: the structure is wrong
            return None, self._reject(path, HEADER, f"{type(exc).__name__}: {exc}")
        os.utime(path)
        return entry, ""

    def _load(self, path: Path, record: DiskRecord) -> Entry:
        with open(path, "rb") as f:
            header = read_header(path, f=f)
            found = contents(header)
            check_identity(header, found, self.expected)
            if not np.array_equal(found.tokens, record.tokens):
                raise InvalidFile(HEADER, "tokens differ from the index")
            tensors = {info.name: _as_mlx(raw).view(_DTYPE[info.dtype]).reshape(info.shape)
                       for info, raw in stream_tensors(f, header, _mlx_buffer)}
        # Only now, with both digests verified, is anything built from the file.
        length = len(found.tokens)
        kv = MlxKV(_unflatten("kv", found.kv_meta, tensors), length)
        head = MlxSnapshot(_unflatten("head", found.head_meta, tensors), length)
        now = clock.steady()  # the policy's clock (server_patch.clock)
        checkpoints = [Checkpoint(cp_len, kind, MlxSnapshot(_unflatten(f"cp{i}", cp_meta, tensors), cp_len),
                                  created=now, reply_end=cp_len in found.reply_ends)
                       for i, ((cp_len, kind), cp_meta) in enumerate(zip(found.checkpoints, found.cp_meta))]
        # Building every restore point once proves shapes and lengths agree before we trust it.
        for point in [head, *[c.state for c in checkpoints]]:
            self.layout.build(kv, point, point.length)
        mx.eval(kv.arrays(), head.arrays(), [a for c in checkpoints for a in c.state.arrays()])
        return Entry(id=record.id, tokens=found.tokens, kv=kv, head=head, namespace=found.namespace,
                     created=now, last_used=now, is_anchor=found.is_anchor, pinned=record.pinned,
                     checkpoints=checkpoints, label=found.label, prompt_end=found.prompt_end)

    def close(self, timeout: float = 30.0) -> bool:
        """Finish the queued writes (at most ``timeout`` seconds; what is still queued then is
        dropped, its entries stay unwritten); later writes are refused. Returns whether every
        queued write finished."""
        complete = self.flush(timeout)
        self._closed = True
        if self.peers is not None:
            self.peers.close()
        dropped = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self._queue.task_done()
            dropped += 1
        if dropped:
            log.warning("lineage disk: %d queued writes dropped at close of %s", dropped, self.root)
        if self._owns_writer:
            self._writer.close(timeout)  # its thread goes back to the park (``infra.workers``)
        return complete and not dropped

    @property
    def closed(self) -> bool:
        return self._closed


def _unlink(path: Path, reason: str | None) -> None:
    try:
        path.unlink()
        if reason:
            log.warning("lineage disk: removed %s (%s)", path.name, reason)
    except FileNotFoundError:
        pass
