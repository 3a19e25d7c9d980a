"""Every byte of a model's weight files, hashed: xxh3-128 per file, cached by the file's stat.

The disk tier's fingerprint must move when any weight does: a sample of each tensor missed
rows scaled in the middle of one, and a restarted server restored the old weights' state. So
each weight file (``config.json``, the safetensors index and every ``*.safetensors`` that
mlx-vlm loads) is read in full, streamed through xxh3-128 (memory speed; the read is what costs).

Each file's digest is cached in one small 0600 JSON file (``<state dir>/weights-hashes.json``),
keyed by the resolved path, size, mtime_ns, ctime_ns, inode and device: a rewrite in place moves
mtime and ctime (ctime cannot be set back by ``touch``), a replacement by rename moves the inode.
A start with unchanged files reads only their stat; a changed file is read again. A file that
changes while it is hashed is hashed again; one still changing after that is an error.

Files changed after this process started may not be what it loaded (the load and the hash are
not one read), so ``changed_since_start`` says so and the caller keeps the disk tier off.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import xxhash

from server_patch.private_files import create_private, fsync_fd, private_dir

log = logging.getLogger("server_patch.lineage")

CACHE_NAME = "weights-hashes.json"
CACHE_FORMAT = 1
CHUNK = 8 << 20
HASH_TRIES = 3
# psutil's process start time is whole boot seconds plus clock ticks: up to ~1 s early.
START_SLACK_NS = 2_000_000_000
# One hash at a time: the runtime's call waits for the launcher's prehash, then hits its cache.
# The process's, on purpose: the files and their digest cache are shared by every runtime.
_HASHING = threading.Lock()


class WeightsUnreadable(OSError):
    """The weight files could not be hashed: nothing keyed by them may be trusted."""


@dataclass(frozen=True)
class FileKey:
    """What must be unchanged for a cached digest to hold."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path) -> "FileKey":
        st = path.stat()
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def text(self) -> str:
        return f"{self.size}:{self.mtime_ns}:{self.ctime_ns}:{self.inode}:{self.device}"


def weight_files(model_dir: Path) -> list[Path]:
    """The files mlx-vlm builds the weights from, in name order (symlinks resolved: the Hub
    cache links snapshot names to blobs)."""
    model_dir = Path(model_dir)
    names = ["config.json", "model.safetensors.index.json"]
    files = [model_dir / n for n in names if (model_dir / n).is_file()]
    files += sorted(model_dir.glob("*.safetensors"))
    if not any(p.suffix == ".safetensors" for p in files):
        raise WeightsUnreadable(f"{model_dir} has no *.safetensors")
    return files


def hash_file(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stable_digest(path: Path) -> tuple[str, FileKey]:
    """The digest of a file that did not change while it was read, and its key."""
    for _ in range(HASH_TRIES):
        before = FileKey.of(path)
        digest = hash_file(path)
        if FileKey.of(path) == before:
            return digest, before
    raise WeightsUnreadable(f"{path} kept changing while it was hashed")


class DigestCache:
    """``{resolved path: {"key": FileKey.text(), "xxh3_128": digest}}`` in one 0600 file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.files: dict[str, dict[str, str]] = self._read()
        self.changed = False

    def _read(self) -> dict[str, dict[str, str]]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        files = data.get("files") if isinstance(data, dict) and data.get("format") == CACHE_FORMAT else None
        return {k: v for k, v in (files or {}).items()
                if isinstance(v, dict) and isinstance(v.get("key"), str) and isinstance(v.get("xxh3_128"), str)}

    def get(self, name: str, key: FileKey) -> str | None:
        hit = self.files.get(name)
        return hit["xxh3_128"] if hit is not None and hit["key"] == key.text() else None

    def put(self, name: str, key: FileKey, digest: str) -> None:
        self.files[name] = {"key": key.text(), "xxh3_128": digest}
        self.changed = True

    def save(self) -> None:
        """Atomically, files that no longer exist dropped; a cache that cannot be written only
        costs the next start a full read."""
        if self.path is None or not self.changed:
            return
        files = {k: v for k, v in self.files.items() if os.path.exists(k)}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            private_dir(self.path.parent, tighten=False)
            tmp.unlink(missing_ok=True)
            fd = create_private(tmp)
            with os.fdopen(fd, "w") as f:
                json.dump({"format": CACHE_FORMAT, "files": files}, f, sort_keys=True)
                f.flush()
                fsync_fd(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("apc_lineage: cannot save the weight hashes to %s: %s", self.path, exc)


def weights_digest(model_dir: Path, cache_path: Path | None = None) -> str:
    """xxh3-128 over every weight file's name and digest. Raises ``WeightsUnreadable``."""
    with _HASHING:
        return _weights_digest(Path(model_dir), cache_path)


def _weights_digest(model_dir: Path, cache_path: Path | None) -> str:
    try:
        files = weight_files(model_dir)
        cache = DigestCache(cache_path)
        total = xxhash.xxh3_128()
        for path in files:
            name = str(path.resolve())
            key = FileKey.of(path)
            digest = cache.get(name, key)
            if digest is None:
                digest, key = _stable_digest(path)
                cache.put(name, key, digest)
            total.update(f"{path.name}\0{digest}\0".encode())
    except WeightsUnreadable:
        raise
    except OSError as exc:
        raise WeightsUnreadable(f"cannot hash the weights in {model_dir}: {exc}") from exc
    cache.save()
    return total.hexdigest()


def changed_since_start(model_dir: Path, started_ns: int | None = None) -> list[Path]:
    """Weight files changed (ctime) after this process started: what was loaded may be the old
    bytes and what was hashed the new ones, so neither can key the disk tier."""
    if started_ns is None:
        import psutil

        started_ns = int(psutil.Process().create_time() * 1e9)
    out = []
    for path in weight_files(model_dir):
        try:
            if path.stat().st_ctime_ns > started_ns + START_SLACK_NS:
                out.append(path)
        except OSError:
            out.append(path)
    return out


def digest_cache_path() -> Path:
    """Where the digests are cached: the server's state directory."""
    from server_patch.paths import state_dir

    return state_dir() / CACHE_NAME


def model_argument(args: list[str]) -> str | None:
    """``--model X`` / ``--model=X`` of the server's command line."""
    for i, arg in enumerate(args):
        if arg == "--model" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return None


def prehash(args: list[str]) -> threading.Thread | None:
    """Start hashing a local ``--model`` directory now, beside the model load (both read the
    same bytes; the second read comes from the page cache), so a first start after a weight
    change does not pay for the hash after the load. A Hub id is hashed when the model loads."""
    model = model_argument(args)
    if model is None or not Path(model).expanduser().is_dir():
        return None
    directory = Path(model).expanduser()

    def run() -> None:
        try:
            weights_digest(directory, digest_cache_path())
        except (WeightsUnreadable, ValueError) as exc:  # the runtime's own call reports it
            log.debug("apc_lineage: weight prehash of %s failed: %s", directory, exc)

    thread = threading.Thread(target=run, name="apc-weights-hash", daemon=True)
    thread.start()
    return thread
