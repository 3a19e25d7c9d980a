"""One check: restore points of one entry against a cold prefill of the same tokens.

For a point at length L the probe token is the entry's token L (for the head, which has no
next token stored, its own last token again). The restored side is what a request gets:
``CacheLayout.build`` over the policy's handles at L, then one forward of the probe. The cold
side is one chunked prefill of the entry's tokens plus the probe from a fresh cache, its
chunks ending at every L + 1, so one pass serves every point of the entry. Between chunks
``should_yield`` is asked; a yes abandons the check (``Abandoned``) with nothing changed.

Long entries: a cold prefill costs as much as the request that made the entry did. Points
past ``max_tokens`` are checked against a *window*: from the earliest restore point at most
``max_tokens`` before them (of the same entry, or of an anchor its tokens start with), restored and prefilled forward (a recurrent
model has no state to start a window from other than a stored one). That proves the point
agrees with the window's base, whose own check (cold, or a window further back) completes
the proof. A point with no restore point close enough before it is skipped, saying so.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from server_patch import clock
from server_patch.canary.compare import Comparison, Tolerance, compare
from server_patch.canary.points import Point

PASS, FAIL, SKIP, ERROR = "pass", "fail", "skip", "error"


class Abandoned(Exception):
    """A request arrived: the check stopped at a chunk boundary and will be retried."""


@dataclass
class Result:
    point: Point
    result: str
    reason: str
    checked_tokens: int = 0  # tokens the reference side computed (the cost of the check)
    base: int = 0  # where the reference started: 0 for a cold prefill, else a window's base
    comparison: Comparison | None = None
    at: float = field(default_factory=clock.wall)  # shown, never subtracted

    def as_dict(self) -> dict[str, Any]:
        return {**self.point.as_dict(), "result": self.result, "reason": self.reason,
                "checked_tokens": self.checked_tokens,
                "mode": "-" if not self.checked_tokens else "cold" if self.base == 0 else "window",
                "base": self.base, "time": self.at,
                **(self.comparison.as_dict() if self.comparison is not None else {})}


@dataclass(frozen=True)
class Settings:
    chunk: int = 128  # tokens per forward between two looks at the request queue
    max_tokens: int = 8192  # the longest reference prefill one point may cost


def _logits(model: Any, tokens: np.ndarray, cache: list[Any]) -> mx.array:
    out = model(mx.array(tokens.astype(np.int32))[None], cache=cache)
    logits = getattr(out, "logits", out)[0, -1].astype(mx.float32)
    try:  # keep the lazy graph one chunk deep, as a request's prefill does
        mx.eval(logits, [c.state for c in cache])
    except (AttributeError, TypeError):  # a cache child nothing wrote (no state to evaluate)
        mx.eval(logits)
    return logits


def check_entry(model: Any, layout: Any, entry: Any, targets: list[Point], tol: Tolerance,
                settings: Settings, should_yield: Callable[[], bool],
                memo: dict[bytes, np.ndarray] | None = None, media: frozenset[int] = frozenset(),
                bases: dict[int, tuple[Any, Any]] | None = None) -> list[Result]:
    """Check ``targets`` (points of ``entry``, which may be a temporary entry loaded from disk).

    ``memo`` (one per job) keeps cold logits by the tokens they follow: a disk file of an entry
    also in RAM, or an anchor inside a conversation, costs no second cold pass. Points whose
    tokens hold ``media`` placeholders are skipped: their state came from vision or audio
    embeddings a text-only cold prefill does not have. ``bases`` adds window bases from other
    entries whose tokens are a prefix of this one's (an anchor): length -> (kv, snapshot)."""
    memo = {} if memo is None else memo
    tokens = np.asarray(entry.tokens, dtype=np.int32)
    seq = np.concatenate([tokens, tokens[-1:]])  # the probe after the head: its last token again
    states = {length: (cp.state if cp is not None else entry.head)
              for length, _, cp in entry.restore_points()}
    starts = {**(bases or {}), **{length: (entry.kv, state) for length, state in states.items()}}
    results: list[Result] = []
    by_base: dict[int, list[Point]] = {}
    for point in sorted(targets, key=lambda p: p.length):
        if point.length not in states:
            results.append(Result(point, SKIP, f"entry holds no restore point at {point.length} any more"))
            continue
        if media and np.isin(seq[:point.length + 1], list(media)).any():
            results.append(Result(point, SKIP, "its tokens hold image/audio/video placeholders: a text-only "
                                               "cold prefill cannot reproduce the state"))
            continue
        base = _base_for(point.length, sorted(starts), settings.max_tokens)
        if base is None:
            results.append(Result(point, SKIP, (
                f"needs a {point.length + 1}-token prefill (> APC_CANARY_MAX_TOKENS="
                f"{settings.max_tokens}) and no restore point within that window before it")))
            continue
        by_base.setdefault(base, []).append(point)
    for base, points in sorted(by_base.items()):
        restored = {}
        for point in points:
            if should_yield():
                raise Abandoned()
            cache = layout.build(entry.kv, states[point.length], point.length)  # a request's path
            restored[point.length] = np.array(_logits(model, seq[point.length:point.length + 1], cache))
        stops = [p.length + 1 for p in points]
        reference = {stop: memo[_key(seq, stop)] for stop in stops if not base and _key(seq, stop) in memo}
        missing = [stop for stop in stops if stop not in reference]
        if missing:
            start = layout.build(*starts[base], base) if base else layout.fresh(model)  # --kv-bits too
            reference.update(_reference(model, start, seq, base, missing, settings.chunk, should_yield))
        if not base:
            memo.update({_key(seq, stop): reference[stop] for stop in stops})
        for point in points:
            comparison = compare(restored[point.length], reference[point.length + 1], tol)
            why = comparison.reason if base == 0 else f"{comparison.reason} (against restore@{base} + prefill)"
            results.append(Result(point, PASS if comparison.passed else FAIL, why,
                                  checked_tokens=point.length + 1 - base, base=base, comparison=comparison))
    return results


def _key(seq: np.ndarray, stop: int) -> bytes:
    return hashlib.blake2b(seq[:stop].tobytes(), digest_size=16).digest()


def _base_for(length: int, restore_lengths: list[int], max_tokens: int) -> int | None:
    """0 (a cold prefill) when it fits, else the earliest restore point it fits after."""
    if length + 1 <= max_tokens:
        return 0
    fits = [b for b in restore_lengths if b < length and length + 1 - b <= max_tokens]
    return min(fits) if fits else None


def _reference(model: Any, cache: list[Any], seq: np.ndarray, start: int, stops: list[int], chunk: int,
               should_yield: Callable[[], bool]) -> dict[int, np.ndarray]:
    """Prefill ``seq[start:max(stops)]`` in chunks that also end at every stop; the last-position
    logits at each stop."""
    out: dict[int, np.ndarray] = {}
    wanted = sorted(set(stops))
    pos = start
    for stop in wanted:
        while pos < stop:
            if should_yield():
                raise Abandoned()
            end = min(stop, pos + max(1, chunk))
            logits = _logits(model, seq[pos:end], cache)
            pos = end
        out[stop] = np.array(logits)
    return out


def compute_dtype(model: Any) -> Any:
    """The floating dtype the model's weights are in (quantized weights: their scales')."""
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if isinstance(value, mx.array) and value.dtype in (mx.float32, mx.bfloat16, mx.float16):
            return value.dtype
    return mx.float32
