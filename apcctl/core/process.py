"""What psutil says about a local server process: RSS, CPU, threads and uptime.

One reader for ``apcctl status`` (a one-off sample) and the dashboard (a sampler kept between
polls, so its CPU% covers the time since the last poll instead of blocking for a measurement).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ProcessInfo:
    """The server process as this machine sees it; only known when the server is local."""

    pid: int
    rss_bytes: int
    cpu_percent: float
    threads: int = 0
    uptime_s: float = 0.0


def read(process: psutil.Process, cpu_interval: float | None = None) -> ProcessInfo:
    """One reading; ``cpu_interval`` None measures CPU since this object's previous reading
    (psutil's rule), a number blocks that many seconds to measure it. Raises ``psutil.Error``."""
    with process.oneshot():
        return ProcessInfo(process.pid, process.memory_info().rss, process.cpu_percent(cpu_interval),
                           process.num_threads(), max(0.0, time.time() - process.create_time()))


def sample_once(pid: int | None, cpu_interval: float = 0.1) -> ProcessInfo | None:
    """A reading of ``pid`` with CPU measured over ``cpu_interval`` seconds; None when it is gone."""
    if pid is None:
        return None
    try:
        return read(psutil.Process(pid), cpu_interval)
    except psutil.Error:
        return None


class ProcessSampler:
    """Readings of one pid over time; keeps the ``psutil.Process`` so CPU% is measured between samples."""

    def __init__(self) -> None:
        self._process: psutil.Process | None = None

    def sample(self, pid: int | None) -> ProcessInfo | None:
        if pid is None:
            return None
        try:
            if self._process is None or self._process.pid != pid:
                self._process = psutil.Process(pid)
                self._process.cpu_percent(None)  # the first call only starts the measurement
            return read(self._process)
        except psutil.Error:
            self._process = None
            return None
