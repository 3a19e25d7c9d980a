"""Per-layer-kind timing of glm5_next forwards, switched on by a flag file.

A forward checks the flag with one ``os.stat`` (``begin_forward``); when the file is absent
every hook returns at once and nothing is evaluated, timed or written. When present, each
hook evaluates the hidden state at a layer boundary and adds the time since the previous hook
to that part's kind, and ``end_forward`` logs one JSON line per forward (chunk length, batch,
milliseconds per kind) to the logger and to the log file. Evaluating at boundaries serialises
MLX's lazy graph, so a profiled forward is a little slower than an unprofiled one.

The hooks go into mlx-vlm's glm5_next text model by the overlay: ``begin_forward`` before the
layer loop, ``after_attention`` inside each decoder layer, ``after_layer`` after each layer,
``end_forward`` after the final norm. Meant for the single generation thread of a server.

The flag lives in the server's state directory (``<state>/profile``, 0700), not the shared temp
dir where any local user could switch profiling on. The generation thread never opens the log:
``end_forward`` queues the line and a writer thread appends it, opening the file
``O_NOFOLLOW | O_NONBLOCK`` as a regular file only, 0600 (a FIFO or symlink planted in its place
is refused and the record dropped with a warning, never a hung inference).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import stat
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Optional

from server_patch import clock, settings
from server_patch.infra.workers import Worker
from server_patch.private_files import FILE_MODE, open_private, private_dir

ENV_FLAG = "APC_PROFILE_FLAG"
ENV_LOG = "APC_PROFILE_LOG"
DEFAULT_FLAG_NAME = "layers.flag"
PROFILE_DIR = "profile"  # under the server's state directory, 0700
QUEUED_LINES = 4096  # records waiting for the writer; beyond, a record is dropped (never a wait)

SPARSE_ATTENTION = "sparse_attention"
LINEAR_ATTENTION = "linear_attention"
MOE = "moe"
DENSE_MLP = "dense_mlp"
OTHER = "other"  # embedding, hyper-connection expansion, final norm

logger = logging.getLogger(__name__)


def flag_path(path: Optional[os.PathLike] = None) -> Path:
    """The flag file: ``path``, else ``$APC_PROFILE_FLAG``, else ``<state dir>/profile/layers.flag``."""
    if path is not None:
        return Path(path)
    env = settings.value(ENV_FLAG)
    if env:
        return Path(env)
    from server_patch.paths import state_dir

    return state_dir() / PROFILE_DIR / DEFAULT_FLAG_NAME


def log_path(path: Optional[os.PathLike] = None) -> Path:
    """Where records go: ``$APC_PROFILE_LOG``, else beside the flag file (``<flag>.jsonl``)."""
    env = settings.value(ENV_LOG)
    if env:
        return Path(env)
    flag = flag_path(path)
    return flag.with_name(flag.name + ".jsonl")


def enable(path: Optional[os.PathLike] = None) -> Path:
    """Create the flag file; forwards that start afterwards are timed."""
    flag = flag_path(path)
    private_dir(flag.parent, tighten=flag.parent.name == PROFILE_DIR)
    os.close(open_private(flag, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK))
    return flag


def disable(path: Optional[os.PathLike] = None) -> bool:
    """Remove the flag file; returns whether it was there."""
    try:
        flag_path(path).unlink()
        return True
    except FileNotFoundError:
        return False


def is_enabled(path: Optional[os.PathLike] = None) -> bool:
    """Whether the flag file exists (the same single stat a forward does)."""
    try:
        os.stat(flag_path(path))
        return True
    except OSError:
        return False


def read_records(limit: int = 10, path: Optional[os.PathLike] = None) -> list[dict]:
    """The last ``limit`` records from the log file (empty if there is none), after this
    process's queued ones are written."""
    PROFILE_LOG.drain()
    try:
        fd = open_regular(log_path(path), os.O_RDONLY)
    except FileNotFoundError:
        return []
    with os.fdopen(fd, "r") as f:
        lines = f.read().splitlines()
    return [json.loads(line) for line in lines[-limit:] if line.strip()]


def open_regular(path: Path, flags: int) -> int:
    """``path`` opened without following a symlink or waiting on a FIFO; anything but a regular
    file raises ``OSError``. A file created here is 0600."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file: refusing to use it as the profile log")
        if flags & (os.O_WRONLY | os.O_RDWR):
            os.fchmod(fd, FILE_MODE)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class LogWriter:
    """Appends records to the log on a worker thread (``infra.workers``): the generation thread
    only queues, and a full queue drops the record (never a wait)."""

    def __init__(self) -> None:
        self._worker = Worker("apc-profile-log", capacity=QUEUED_LINES)
        self._exit_hook = False
        self.dropped = 0

    def submit(self, line: str) -> None:
        if not self._worker.submit(lambda: self._append(line)):
            self.dropped += 1
            return
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(self.drain)

    def drain(self, timeout: float = 2.0) -> None:
        """Wait (up to ``timeout``) for the queued records to be written: at exit."""
        self._worker.drain(timeout)

    @staticmethod
    def _append(line: str) -> None:
        try:
            target = log_path()
            private_dir(target.parent, tighten=target.parent.name == PROFILE_DIR)
            fd = open_regular(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError as error:  # a full or read-only disk, a FIFO or link in its place
            logger.warning("layer profile not written: %s", error)


# The process's one profile log, on purpose (a registered process-level object, ``tests/test_layout.py``):
# the flag file and the log belong to the process, not to a model (a switch keeps profiling on),
# and what it holds is lines of the process's forwards, no runtime's state.
PROFILE_LOG = LogWriter()


class ForwardTimer:
    """Accumulates wall time per layer kind across one forward."""

    def __init__(self, length: int, batch: int) -> None:
        self.length = length
        self.batch = batch
        self.seconds: dict[str, float] = {}
        self.layers: dict[str, int] = {}
        self._start = self._last = time.perf_counter()

    def lap(self, kind: str, *values: Any) -> None:
        """Finish the lazy work behind ``values`` and charge the elapsed time to ``kind``."""
        import mlx.core as mx

        mx.eval(*values)
        now = time.perf_counter()
        self.seconds[kind] = self.seconds.get(kind, 0.0) + now - self._last
        self.layers[kind] = self.layers.get(kind, 0) + 1
        self._last = now

    def record(self) -> dict:
        return {
            "time": clock.wall(),
            "chunk": self.length,
            "batch": self.batch,
            "total_ms": round((self._last - self._start) * 1e3, 3),
            "ms": {kind: round(s * 1e3, 3) for kind, s in self.seconds.items()},
            "layers": dict(self.layers),
        }


# The forward being timed on this thread: each runtime's generation thread times its own, so
# two models served in one process never lap into each other's record.
_FORWARD: ContextVar[Optional[ForwardTimer]] = ContextVar("apc_profiled_forward", default=None)


def begin_forward(hidden: Any) -> Optional[ForwardTimer]:
    """Start timing a forward over ``hidden`` [B, L, ...] if the flag file exists (one stat)."""
    if not is_enabled():
        _FORWARD.set(None)
        return None
    timer = ForwardTimer(length=int(hidden.shape[1]), batch=int(hidden.shape[0]))
    _FORWARD.set(timer)
    timer.lap(OTHER, hidden)
    return timer


def attention_kind(decoder_layer: Any) -> str:
    return LINEAR_ATTENTION if getattr(decoder_layer, "is_linear", False) else SPARSE_ATTENTION


def mlp_kind(decoder_layer: Any) -> str:
    return MOE if hasattr(decoder_layer.mlp, "switch_mlp") else DENSE_MLP


def after_attention(decoder_layer: Any, hidden: Any) -> None:
    """Charge the time since the previous hook to the layer's attention kind."""
    if (timer := _FORWARD.get()) is not None:
        timer.lap(attention_kind(decoder_layer), hidden)


def after_layer(decoder_layer: Any, hidden: Any) -> None:
    """Charge the time since ``after_attention`` to the layer's MLP kind (MoE or dense)."""
    if (timer := _FORWARD.get()) is not None:
        timer.lap(mlp_kind(decoder_layer), hidden)


def end_forward(hidden: Any) -> Optional[dict]:
    """Close the forward's timer and log its record (nothing when not timing)."""
    timer = _FORWARD.get()
    _FORWARD.set(None)
    if timer is None:
        return None
    timer.lap(OTHER, hidden)
    record = timer.record()
    line = json.dumps(record, sort_keys=True)
    logger.info("layer profile %s", line)
    PROFILE_LOG.submit(line)  # never open() on the generation thread: the log could be a FIFO
    return record
