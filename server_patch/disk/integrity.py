"""The lineage file format and everything that decides whether a file may be trusted.

A file is safetensors: an 8-byte little-endian header size, a JSON header (the tensor table and
``__metadata__``, all strings), then the tensors' bytes back to back. Two xxh3-128 digests sit
in the metadata:

* ``data_hash`` over the data region, streamed in file order;
* ``hash`` over the canonical JSON of the whole header without ``hash`` itself: every metadata
  string (tokens, checkpoint lengths, layouts, ``data_hash``) and every dtype, shape and offset.

The index rebuild checks ``hash`` (header only, cheap); a load also checks ``data_hash`` while it
reads the tensors. xxh3 is not a cryptographic hash: it catches bit rot, torn writes and edits
made without recomputing it; the 0600/0700 modes are what keep other users out.

Nothing here imports MLX, so ``apcctl check`` can verify files without a model.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, TypeVar

import numpy as np
import xxhash

FORMAT = "apc-lineage-v2"
SUFFIX = ".safetensors"
TMP_MARK = ".tmp"
HASH_HEX = 32  # xxh3_128 hex digest length: placeholders and digests have the same size
MAX_HEADER = 64 << 20
CHUNK = 8 << 20

# Reasons a file is rejected; DiskStore.rejects and apcctl check count by these.
TRUNCATED, HEADER, FORMAT_REASON, HASH, FINGERPRINT, IO = (
    "truncated", "header", "format", "hash", "fingerprint", "io")

ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4,
            "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}
_META_KEYS = ("format", "fingerprint", "identity", "layout", "namespace", "length", "tokens",
              "is_anchor", "pinned", "label", "checkpoints", "kv_meta", "head_meta", "cp_meta",
              "data_hash", "hash")
ARRAY = "@array"
T = TypeVar("T")


class InvalidFile(ValueError):
    """A file that must not be restored from; ``reason`` is one of the reason constants."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A parsed header whose structure, format and ``hash`` were checked."""

    meta: dict[str, str]
    tensors: tuple[TensorInfo, ...]  # in file order
    data_start: int
    file_size: int


@dataclass(frozen=True)
class Contents:
    """The metadata decoded and cross-checked against the tensor table."""

    tokens: np.ndarray
    checkpoints: tuple[tuple[int, str], ...]
    kv_meta: list
    head_meta: list
    cp_meta: list
    identity: dict[str, str]
    namespace: str
    is_anchor: bool
    pinned: bool
    label: str
    prompt_end: int = 0  # reply reuse: the protected prompt end, one of the checkpoint lengths
    reply_ends: tuple[int, ...] = ()  # checkpoint lengths that sit at the end of a reply


def canonical(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def header_digest(header: dict) -> str:
    """xxh3-128 of the header without its own ``hash``."""
    meta = dict(header.get("__metadata__") or {})
    meta.pop("hash", None)
    return xxhash.xxh3_128_hexdigest(canonical({**header, "__metadata__": meta}))


def data_hasher() -> "xxhash.xxh3_128":
    return xxhash.xxh3_128()


# ---------------------------------------------------------------------- writing


@dataclass
class TableRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def build_header(meta: dict[str, str], table: list[TableRow], data_hash: str) -> bytes:
    """The file's first bytes (size + JSON, space-padded to 8) with both digests filled in.

    Called once with a placeholder ``data_hash`` before the data is streamed and once after;
    both results have the same length, so the second overwrites the first in place.
    """
    if len(data_hash) != HASH_HEX:
        raise ValueError("data_hash must be an xxh3-128 hex digest")
    header: dict[str, Any] = {}
    offset = 0
    for row in table:
        header[row.name] = {"dtype": row.dtype, "shape": list(row.shape),
                            "data_offsets": [offset, offset + row.nbytes]}
        offset += row.nbytes
    header["__metadata__"] = {**meta, "format": FORMAT, "data_hash": data_hash, "hash": "0" * HASH_HEX}
    header["__metadata__"]["hash"] = header_digest(header)
    body = canonical(header)
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


# ---------------------------------------------------------------------- reading


def read_header(path: Path | str, *, f: BinaryIO | None = None) -> Header:
    """Parse and check the header: structure, sizes, format and ``hash`` (no tensor is read)."""
    if f is None:
        with open(path, "rb") as handle:
            return read_header(path, f=handle)
    raw = f.read(8)
    if len(raw) != 8:
        raise InvalidFile(TRUNCATED, "shorter than a header")
    (size,) = struct.unpack("<Q", raw)
    if not 2 <= size <= MAX_HEADER:
        raise InvalidFile(HEADER, f"implausible header size {size}")
    body = f.read(size)
    if len(body) != size:
        raise InvalidFile(TRUNCATED, "header cut short")
    file_size = os.fstat(f.fileno()).st_size
    try:
        header = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidFile(HEADER, f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidFile(HEADER, "header is not a JSON object")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InvalidFile(HEADER, "__metadata__ is not a map of strings")
    if meta.get("format") != FORMAT:
        raise InvalidFile(FORMAT_REASON, f"format {meta.get('format')!r} is not {FORMAT}")
    tensors = _tensor_table(header)
    data_len = tensors[-1].end if tensors else 0
    expected = 8 + size + data_len
    if file_size < expected:
        raise InvalidFile(TRUNCATED, f"file is {file_size} bytes, header describes {expected}")
    if file_size > expected:
        raise InvalidFile(HEADER, f"file is {file_size} bytes, header describes {expected}")
    if meta.get("hash") != header_digest(header):
        raise InvalidFile(HASH, "header hash does not match")
    return Header(meta=meta, tensors=tensors, data_start=8 + size, file_size=file_size)


def _tensor_table(header: dict) -> tuple[TensorInfo, ...]:
    """Every tensor entry well formed, sized by its dtype and shape, tiling the data region."""
    rows = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict):
            raise InvalidFile(HEADER, f"tensor {name!r} entry is not an object")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise InvalidFile(HEADER, f"tensor {name!r} has dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise InvalidFile(HEADER, f"tensor {name!r} has shape {shape!r}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise InvalidFile(HEADER, f"tensor {name!r} has data_offsets {offsets!r}")
        begin, end = offsets
        if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
            raise InvalidFile(HEADER, f"tensor {name!r} size does not match its dtype and shape")
        rows.append(TensorInfo(name, dtype, tuple(shape), begin, end))
    rows.sort(key=lambda t: (t.begin, t.end))
    position = 0
    for row in rows:
        if row.begin != position:
            raise InvalidFile(HEADER, f"tensor {row.name!r} does not start where the previous ended")
        position = row.end
    return tuple(rows)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def numpy_buffer(nbytes: int) -> tuple[np.ndarray, memoryview]:
    buf = np.empty(nbytes, dtype=np.uint8)
    return buf, memoryview(buf)


def stream_tensors(f: BinaryIO, header: Header,
                   alloc: Callable[[int], tuple[T, memoryview]] = numpy_buffer) -> Iterator[tuple[TensorInfo, T]]:
    """Each tensor's bytes, in file order, read into ``alloc(nbytes)``'s writable view (so the
    caller can read straight into the memory that will hold the array), and checked against
    ``data_hash`` once all are read.

    The caller must not trust anything it built from the tensors unless the iteration ends
    without raising (the digest is only known at the end).
    """
    f.seek(header.data_start)
    hasher = data_hasher()
    for info in header.tensors:
        owner, view = alloc(info.nbytes)
        if f.readinto(view) != info.nbytes:
            raise InvalidFile(TRUNCATED, f"tensor {info.name!r} cut short")
        hasher.update(view)
        yield info, owner
    if hasher.hexdigest() != header.meta["data_hash"]:
        raise InvalidFile(HASH, "tensor data hash does not match")


def verify_data(path: Path | str, header: Header) -> None:
    """Stream the data region through the hash in fixed-size chunks (``apcctl check``)."""
    hasher = data_hasher()
    remaining = header.file_size - header.data_start
    with open(path, "rb") as f:
        f.seek(header.data_start)
        while remaining > 0:
            chunk = f.read(min(CHUNK, remaining))
            if not chunk:
                raise InvalidFile(TRUNCATED, "data region cut short")
            hasher.update(chunk)
            remaining -= len(chunk)
    if hasher.hexdigest() != header.meta["data_hash"]:
        raise InvalidFile(HASH, "tensor data hash does not match")


# ---------------------------------------------------------------------- contents


def decode_tokens(text: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidFile(HEADER, "tokens are not base64") from None
    if len(raw) % 4:
        raise InvalidFile(HEADER, "tokens are not int32")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


def encode_tokens(tokens: np.ndarray) -> str:
    return base64.b64encode(np.asarray(tokens, dtype="<i4").tobytes()).decode("ascii")


def contents(header: Header) -> Contents:
    """Decode the metadata; every mismatch with itself or the tensor table is a ``header`` reject."""
    meta = header.meta
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise InvalidFile(HEADER, f"metadata lacks {missing}")
    tokens = decode_tokens(meta["tokens"])
    if not meta["length"].isdigit() or len(tokens) != int(meta["length"]):
        raise InvalidFile(HEADER, "token count does not match length")
    checkpoints = _checkpoints(_json(meta, "checkpoints"), len(tokens))
    kv_meta, head_meta, cp_meta = (_json(meta, k) for k in ("kv_meta", "head_meta", "cp_meta"))
    if not isinstance(cp_meta, list) or len(cp_meta) != len(checkpoints):
        raise InvalidFile(HEADER, "cp_meta does not match the checkpoints")
    referenced: list[str] = []
    for prefix, layers in [("kv", kv_meta), ("head", head_meta),
                           *[(f"cp{i}", m) for i, m in enumerate(cp_meta)]]:
        referenced.extend(array_names(prefix, layers))
    if sorted(referenced) != sorted(t.name for t in header.tensors):
        raise InvalidFile(HEADER, "tensor table does not match the layer metadata")
    identity = _json(meta, "identity")
    if not isinstance(identity, dict) or not all(isinstance(v, str) for v in identity.values()):
        raise InvalidFile(HEADER, "identity is not a map of strings")
    prompt_end, reply_ends = _reply_marks(meta, {length for length, _ in checkpoints})
    return Contents(tokens=tokens, checkpoints=checkpoints, kv_meta=kv_meta, head_meta=head_meta,
                    cp_meta=cp_meta, identity=identity, namespace=meta["namespace"],
                    is_anchor=meta["is_anchor"] == "1", pinned=meta["pinned"] == "1", label=meta["label"],
                    prompt_end=prompt_end, reply_ends=reply_ends)


def _reply_marks(meta: dict[str, str], lengths: set[int]) -> tuple[int, tuple[int, ...]]:
    """Reply reuse's marks, optional (files written before them carry none): the prompt end is
    0 or a checkpoint length, and every reply end is a checkpoint length."""
    raw = meta.get("prompt_end", "0")
    if not raw.isdigit() or (int(raw) and int(raw) not in lengths):
        raise InvalidFile(HEADER, "prompt_end is not one of the checkpoints")
    ends = _json(meta, "reply_ends") if "reply_ends" in meta else []
    if not isinstance(ends, list) or not all(_is_count(n) and n in lengths for n in ends):
        raise InvalidFile(HEADER, "reply_ends are not checkpoint lengths")
    return int(raw), tuple(ends)


def _json(meta: dict[str, str], key: str) -> Any:
    try:
        return json.loads(meta[key])
    except ValueError:
        raise InvalidFile(HEADER, f"{key} is not JSON") from None


def _checkpoints(value: Any, length: int) -> tuple[tuple[int, str], ...]:
    if not isinstance(value, list):
        raise InvalidFile(HEADER, "checkpoints is not a list")
    out = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and _is_count(item[0]) and isinstance(item[1], str)):
            raise InvalidFile(HEADER, f"checkpoint {item!r} is not [length, kind]")
        if not 0 < item[0] < length:
            raise InvalidFile(HEADER, "checkpoint outside the entry")
        out.append((item[0], item[1]))
    return tuple(out)


def array_names(prefix: str, layers: Any) -> list[str]:
    """Tensor names a layer metadata list refers to; a malformed list is a ``header`` reject."""
    if not isinstance(layers, list):
        raise InvalidFile(HEADER, f"{prefix} metadata is not a list of layers")
    names = []
    for li, layer in enumerate(layers):
        if not isinstance(layer, list):
            raise InvalidFile(HEADER, f"{prefix} layer {li} is not a list")
        for ci, child in enumerate(layer):
            if not isinstance(child, dict):
                raise InvalidFile(HEADER, f"{prefix} layer {li} child {ci} is not an object")
            names.extend(f"{prefix}.{li}.{ci}.{key}" for key, value in child.items() if value == ARRAY)
    return names


# ---------------------------------------------------------------------- identity


@dataclass(frozen=True)
class Expected:
    """What a file must have been written for; ``None`` fields are not checked."""

    identity: dict[str, str]
    fingerprint: str | None = None
    fingerprint_prefix: str | None = None
    layout: str | None = None


def check_identity(header: Header, found: Contents, expected: Expected) -> None:
    """Another model, layout, mlx / mlx-vlm / patch version: a ``fingerprint`` reject."""
    meta = header.meta
    if expected.fingerprint is not None and meta["fingerprint"] != expected.fingerprint:
        raise InvalidFile(FINGERPRINT, "written for another model fingerprint")
    if expected.fingerprint_prefix is not None and not meta["fingerprint"].startswith(expected.fingerprint_prefix):
        raise InvalidFile(FINGERPRINT, f"fingerprint does not match its directory {expected.fingerprint_prefix}")
    if expected.layout is not None and meta["layout"] != expected.layout:
        raise InvalidFile(FINGERPRINT, "written for another cache layout")
    differs = sorted(k for k in set(expected.identity) | set(found.identity)
                     if expected.identity.get(k) != found.identity.get(k))
    if differs:
        detail = ", ".join(f"{k} {found.identity.get(k)!r} (now {expected.identity.get(k)!r})" for k in differs)
        raise InvalidFile(FINGERPRINT, f"written by other software: {detail}")


def temp_name(entry_id: str, thread: int) -> str:
    """``.<id>.<pid>.<thread>.tmp.safetensors``: hidden, and naming the process writing it."""
    return f".{entry_id}.{os.getpid()}.{thread}{TMP_MARK}{SUFFIX}"


def is_temp(path: Path) -> bool:
    return TMP_MARK in path.name


def temp_pid(path: Path) -> int | None:
    """The PID in a temp file's name (None if it has none)."""
    parts = path.name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None
