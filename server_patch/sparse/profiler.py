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
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from server_patch import clock, settings

ENV_FLAG = "APC_PROFILE_FLAG"
ENV_LOG = "APC_PROFILE_LOG"
DEFAULT_FLAG_NAME = "apcctl-profile-layers.flag"

SPARSE_ATTENTION = "sparse_attention"
LINEAR_ATTENTION = "linear_attention"
MOE = "moe"
DENSE_MLP = "dense_mlp"
OTHER = "other"  # embedding, hyper-connection expansion, final norm

logger = logging.getLogger(__name__)


def flag_path(path: Optional[os.PathLike] = None) -> Path:
    """The flag file: ``path``, else ``$APC_PROFILE_FLAG``, else one in the system temp dir."""
    if path is not None:
        return Path(path)
    env = settings.value(ENV_FLAG)
    return Path(env) if env else Path(tempfile.gettempdir()) / DEFAULT_FLAG_NAME


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
    flag.parent.mkdir(parents=True, exist_ok=True)
    flag.touch()
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
    """The last ``limit`` records from the log file (empty if there is none)."""
    try:
        lines = log_path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines[-limit:] if line.strip()]


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


_current: Optional[ForwardTimer] = None


def begin_forward(hidden: Any) -> Optional[ForwardTimer]:
    """Start timing a forward over ``hidden`` [B, L, ...] if the flag file exists (one stat)."""
    global _current
    if not is_enabled():
        _current = None
        return None
    _current = ForwardTimer(length=int(hidden.shape[1]), batch=int(hidden.shape[0]))
    _current.lap(OTHER, hidden)
    return _current


def attention_kind(decoder_layer: Any) -> str:
    return LINEAR_ATTENTION if getattr(decoder_layer, "is_linear", False) else SPARSE_ATTENTION


def mlp_kind(decoder_layer: Any) -> str:
    return MOE if hasattr(decoder_layer.mlp, "switch_mlp") else DENSE_MLP


def after_attention(decoder_layer: Any, hidden: Any) -> None:
    """Charge the time since the previous hook to the layer's attention kind."""
    if _current is not None:
        _current.lap(attention_kind(decoder_layer), hidden)


def after_layer(decoder_layer: Any, hidden: Any) -> None:
    """Charge the time since ``after_attention`` to the layer's MLP kind (MoE or dense)."""
    if _current is not None:
        _current.lap(mlp_kind(decoder_layer), hidden)


def end_forward(hidden: Any) -> Optional[dict]:
    """Close the forward's timer and log its record (nothing when not timing)."""
    global _current
    timer, _current = _current, None
    if timer is None:
        return None
    timer.lap(OTHER, hidden)
    record = timer.record()
    line = json.dumps(record, sort_keys=True)
    logger.info("layer profile %s", line)
    try:
        target = log_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a") as f:
            f.write(line + "\n")
    except OSError as error:  # a full or read-only disk must not break generation
        logger.warning("layer profile not written: %s", error)
    return record
