"""The disk tier: one safetensors file per lineage entry, written atomically in the background.

A file holds the entry's KV rows once, its head snapshot, and each checkpoint's snapshot. The
header carries a format version, the model fingerprint (config + weights hash), the cache
layout, token ids and checkpoint lengths, so the index is rebuilt at start from headers alone.
Loading validates everything; a file that fails is deleted and the request prefills cold.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import queue
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import mlx.core as mx
import numpy as np

from server_patch.lineage.model import Checkpoint, DiskRecord, Entry
from server_patch.state.layout import CacheLayout, MlxKV, MlxSnapshot

log = logging.getLogger("server_patch.disk")

FORMAT = "apc-lineage-v1"
_SUFFIX = ".safetensors"
_TMP_MARK = ".tmp"


class InvalidFile(ValueError):
    """A file that must not be restored from."""


def _encode_tokens(tokens: np.ndarray) -> str:
    return base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode("ascii")


def _decode_tokens(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<i4").astype(np.int32)


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
                    child_meta[key] = "@array"
                else:
                    child_meta[key] = value
            layer_meta.append(child_meta)
        meta.append(layer_meta)
    return meta


def _unflatten(prefix: str, meta: list, tensors: dict[str, mx.array]) -> list[list[dict]]:
    layers = []
    for li, layer_meta in enumerate(meta):
        layer = []
        for ci, child_meta in enumerate(layer_meta):
            child = {}
            for key, value in child_meta.items():
                if value == "@array":
                    name = f"{prefix}.{li}.{ci}.{key}"
                    if name not in tensors:
                        raise InvalidFile(f"missing tensor {name}")
                    child[key] = tensors[name]
                else:
                    child[key] = value
            layer.append(child)
        layers.append(layer)
    return layers


def read_header(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file, without reading any tensor."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise InvalidFile("truncated header")
        (size,) = struct.unpack("<Q", raw)
        if size <= 0 or size > 64 << 20:
            raise InvalidFile("implausible header size")
        body = f.read(size)
        if len(body) != size:
            raise InvalidFile("truncated header")
        f.seek(0, os.SEEK_END)
        file_size = f.tell()
    header = json.loads(body)
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + size + end != file_size:
        raise InvalidFile(f"file is {file_size} bytes, header describes {8 + size + end}")
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT:
        raise InvalidFile(f"format {meta.get('format')!r} is not {FORMAT}")
    return meta


class DiskStore:
    """The policy's ``DiskTier`` over a directory, with one background writer thread."""

    def __init__(self, root: Path | str, *, fingerprint: str, layout: CacheLayout) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.layout = layout
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._run, name="apc-lineage-disk", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------------ index

    def path_of(self, record_id: str) -> Path:
        return self.root / f"{record_id}{_SUFFIX}"

    def records(self) -> Iterable[DiskRecord]:
        """Rebuild the index from headers; stray temp files and invalid files are removed."""
        out = []
        for path in sorted(self.root.glob(f"*{_SUFFIX}")):
            if _TMP_MARK in path.name:
                _unlink(path, "leftover temp file")
                continue
            try:
                out.append(self._record_from_header(path))
            except (InvalidFile, OSError, ValueError, KeyError) as exc:
                _unlink(path, f"invalid header: {exc}")
        return out

    def _record_from_header(self, path: Path) -> DiskRecord:
        meta = read_header(path)
        if meta.get("fingerprint") != self.fingerprint:
            raise InvalidFile("model fingerprint differs")
        if meta.get("layout") != self.layout.describe():
            raise InvalidFile("cache layout differs")
        tokens = _decode_tokens(meta["tokens"])
        if len(tokens) != int(meta["length"]):
            raise InvalidFile("token count does not match length")
        checkpoints = tuple((int(n), str(k)) for n, k in json.loads(meta["checkpoints"]))
        if any(not 0 < n < len(tokens) for n, _ in checkpoints):
            raise InvalidFile("checkpoint outside the entry")
        return DiskRecord(id=path.name[: -len(_SUFFIX)], tokens=tokens, namespace=meta.get("namespace", ""),
                          checkpoints=checkpoints, nbytes=path.stat().st_size,
                          last_used=path.stat().st_mtime, is_anchor=meta.get("is_anchor") == "1",
                          pinned=meta.get("pinned") == "1", label=meta.get("label", ""))

    # ------------------------------------------------------------------ write

    def write(self, entry: Entry, done: Callable[[Entry, DiskRecord | None], None]) -> None:
        """Queue a write; the references taken now are what gets written."""
        # The handles' arrays were evaluated where they were made (CacheLayout.split): an
        # unevaluated array could only be computed on its creator's thread, and this may be
        # called from the idle ticker or an admin request.
        self._queue.put((entry, entry.kv, entry.head, list(entry.checkpoints), done))

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

    def _run(self) -> None:
        # MLX streams are per thread; the writer gets its own on the CPU.
        mx.set_default_stream(mx.new_stream(mx.cpu))
        while True:
            entry, kv, head, checkpoints, done = self._queue.get()
            try:
                record = self._write_now(entry, kv, head, checkpoints)
            except Exception as exc:  # a failed write must not kill the writer
                log.warning("lineage disk write of %s failed: %s", entry.id, exc)
                record = None
            try:
                done(entry, record)
            finally:
                self._queue.task_done()

    def _write_now(self, entry: Entry, kv: MlxKV, head: MlxSnapshot,
                   checkpoints: list[Checkpoint]) -> DiskRecord:
        tensors: dict[str, mx.array] = {}
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "layout": self.layout.describe(),
            "namespace": entry.namespace,
            "length": str(entry.length),
            "tokens": _encode_tokens(entry.tokens),
            "is_anchor": "1" if entry.is_anchor else "0",
            "pinned": "1" if entry.pinned else "0",
            "label": entry.label,
            "checkpoints": json.dumps([[c.length, c.kind] for c in checkpoints]),
            # Rows past the entry (an adopted buffer's spare room) are not state: cut them.
            # Raises while the rows are lent to a running request (the entry stays dirty).
            "kv_meta": json.dumps(_flatten("kv", kv.trimmed_layers(), tensors)),
            "head_meta": json.dumps(_flatten("head", head.layers, tensors)),
            "cp_meta": json.dumps([_flatten(f"cp{i}", c.state.layers, tensors)
                                   for i, c in enumerate(checkpoints)]),
        }
        final = self.path_of(entry.id)
        tmp = self.root / f".{entry.id}.{os.getpid()}{_TMP_MARK}{_SUFFIX}"
        try:
            mx.save_safetensors(str(tmp), tensors, metadata=meta)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            _unlink(tmp, "failed write")
            raise
        stat = final.stat()
        return DiskRecord(id=entry.id, tokens=entry.tokens, namespace=entry.namespace,
                          checkpoints=tuple((c.length, c.kind) for c in checkpoints),
                          nbytes=stat.st_size, last_used=time.time(), is_anchor=entry.is_anchor,
                          pinned=entry.pinned, label=entry.label)

    def delete(self, record_id: str) -> None:
        _unlink(self.path_of(record_id), None)

    # ------------------------------------------------------------------ load

    def load(self, record: DiskRecord) -> Entry | None:
        """The validated entry, or None (and the file removed) if anything is off."""
        path = self.path_of(record.id)
        try:
            entry = self._load(path, record)
        except Exception as exc:
            _unlink(path, f"failed validation: {exc}")
            return None
        os.utime(path)
        return entry

    def _load(self, path: Path, record: DiskRecord) -> Entry:
        meta = read_header(path)
        if meta.get("fingerprint") != self.fingerprint or meta.get("layout") != self.layout.describe():
            raise InvalidFile("fingerprint or layout differs")
        tokens = _decode_tokens(meta["tokens"])
        if not np.array_equal(tokens, record.tokens):
            raise InvalidFile("tokens differ from the index")
        tensors, _ = mx.load(str(path), return_metadata=True)
        length = len(tokens)
        kv = MlxKV(_unflatten("kv", json.loads(meta["kv_meta"]), tensors), length)
        head = MlxSnapshot(_unflatten("head", json.loads(meta["head_meta"]), tensors), length)
        now = time.time()
        checkpoints = []
        for i, ((cp_len, kind), cp_meta) in enumerate(zip(json.loads(meta["checkpoints"]),
                                                          json.loads(meta["cp_meta"]))):
            state = MlxSnapshot(_unflatten(f"cp{i}", cp_meta, tensors), int(cp_len))
            checkpoints.append(Checkpoint(int(cp_len), str(kind), state, created=now))
        # Building every restore point once proves shapes and lengths agree before we trust it.
        for point in [head, *[c.state for c in checkpoints]]:
            self.layout.build(kv, point, point.length)
        mx.eval(kv.arrays(), head.arrays(), [a for c in checkpoints for a in c.state.arrays()])
        return Entry(id=record.id, tokens=tokens, kv=kv, head=head, namespace=meta.get("namespace", ""),
                     created=now, last_used=now, is_anchor=meta.get("is_anchor") == "1",
                     pinned=record.pinned, checkpoints=checkpoints, label=meta.get("label", ""))

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)


def _unlink(path: Path, reason: str | None) -> None:
    try:
        path.unlink()
        if reason:
            log.warning("lineage disk: removed %s (%s)", path.name, reason)
    except FileNotFoundError:
        pass


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
