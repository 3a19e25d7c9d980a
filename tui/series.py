"""What the Live tab's graphs draw: per request, or over wall-clock time.

Per request, each column is one request (the newest at the right), so a burst and a quiet
hour look the same. Over time, each column is an equal slice of the window ending now: a
slice without requests is blank, so idle time shows as a gap. Pure functions over the
request records, so they are tested without a screen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tui.state import reuse_fraction

Record = dict[str, Any]


@dataclass(frozen=True)
class Axis:
    """How the graphs are laid out: ``window_s`` None is one column per request."""

    label: str
    window_s: float | None = None


AXES = (Axis("per request"), Axis("1 min", 60.0), Axis("10 min", 600.0), Axis("1 h", 3600.0))


def reuse(record: Record) -> float:
    return reuse_fraction(record)


def ttft(record: Record) -> float:
    return float(record.get("ttft_ms") or 0.0)


def in_window(records: Sequence[Record], now: float, window_s: float) -> list[Record]:
    start = now - window_s
    return [r for r in records if start <= float(r.get("started") or 0.0) <= now]


def per_request(records: Sequence[Record], value: Callable[[Record], float], columns: int) -> list[float]:
    """The newest ``columns`` requests, oldest first."""
    return [value(r) for r in records[-columns:]] if columns > 0 else []


def over_time(records: Sequence[Record], value: Callable[[Record], float], columns: int, now: float,
              window_s: float, summary: Callable[[list[float]], float]) -> list[float | None]:
    """``columns`` equal slices of the window ending at ``now``; each the ``summary`` of its requests."""
    if columns <= 0:
        return []
    slices: list[list[float]] = [[] for _ in range(columns)]
    start = now - window_s
    for record in in_window(records, now, window_s):
        index = min(columns - 1, int((float(record["started"]) - start) / window_s * columns))
        slices[index].append(value(record))
    return [summary(values) if values else None for values in slices]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def series(records: Sequence[Record], value: Callable[[Record], float], axis: Axis, now: float,
           summary: Callable[[list[float]], float]) -> Callable[[int], list[float | None]]:
    """The graph's data for a width, as ``ScaledSparkline.show`` takes it."""
    if axis.window_s is None:
        return lambda columns: list(per_request(records, value, columns))
    window = axis.window_s
    return lambda columns: over_time(records, value, columns, now, window, summary)
