"""The composition root: the one object that holds the patch's parts for one server process.

``Parts`` is built once, when mlx-vlm builds its ``ServerRuntime`` (the overlay adds the field
``apc_parts`` to that dataclass, ``overlay/patches/lineage.py``), so it lives exactly as long as
the server and sits next to mlx-vlm's own per-process state (``apc_manager``,
``response_generator``). From there it is handed on, never looked up:

* the admin router gets it at ``admin.api.install(app, parts)`` and its routes receive it
  through a FastAPI dependency (``admin.api.parts_of``);
* the canary's runner gets the book and the traffic gate at construction;
* the coordinator factory, the generation loop's idle hook, the unload hook and the shutdown
  flush get it from their call sites in mlx-vlm (``runtime.apc_parts``) through the one door,
  ``integration.hooks``.

Nothing here is a module-level instance. ``of_server()`` reads the field where a call site has
no server in scope: mlx-vlm's generate modules (the coordinator factory); the coordinator then
holds the runtime, which holds the canary and the finder it was handed.
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server_patch.infra.traffic import Traffic
from server_patch.boundaries import SegmentFinder, SegmentSettings
from server_patch.canary.service import Canary

if TYPE_CHECKING:
    from server_patch.integration.runtime import LineageRuntime

log = logging.getLogger("server_patch.lineage")


class Runtimes:
    """The lineage runtimes open in this server, by APC manager: one text model at a time, so
    at most one. A runtime for a new manager replaces any still open, and the replaced one is
    closed first (its unwritten entries written): never two writers in one disk directory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, "LineageRuntime"] = {}

    def replacing(self, manager: object) -> None:
        """A coordinator for ``manager`` is about to be built: close the runtimes of every other
        manager (a model replaced without going through ``retire``)."""
        with self._lock:
            others = [key for key in self._open if key != id(manager)]
            replaced = [self._open.pop(key) for key in others]
        for old in replaced:
            log.warning("apc_lineage runtime %s replaced while still open: closing it", old.fingerprint[:16])
            old.close()

    def adopt(self, manager: object, runtime: "LineageRuntime", parts: "Parts") -> None:
        """``runtime`` serves ``manager`` under ``parts``: it reads their finder and canary."""
        runtime.finder, runtime.canary = parts.finder, parts.canary
        with self._lock:
            if not runtime.closed:
                self._open[id(manager)] = runtime

    def retire(self, manager: object) -> None:
        """mlx-vlm unloads the model of APC ``manager`` (a switch, ``POST /unload``): close its
        runtime before stock clears the manager, so what it held unwritten reaches the disk.
        Never raises."""
        with self._lock:
            runtime = self._open.pop(id(manager), None) if manager is not None else None
        if runtime is None:
            return
        try:
            runtime.close()
        except Exception as exc:
            log.warning("apc_lineage close of runtime %s failed: %s", runtime.fingerprint[:16], exc)

    @property
    def current(self) -> "LineageRuntime | None":
        """The open runtime (the server serves one text model at a time), or None before the
        first request and after an unload."""
        with self._lock:
            return next(reversed(self._open.values()), None) if self._open else None

    def count(self) -> int:
        with self._lock:
            return len(self._open)

    def flush(self, timeout: float | None = None) -> None:
        """Write every open runtime's unwritten entries (graceful shutdown), each for at most
        ``timeout`` seconds (default: its ``shutdown_flush_s``)."""
        with self._lock:
            runtimes = list(self._open.values())
        for runtime in runtimes:
            runtime.flush(runtime.config.shutdown_flush_s if timeout is None else timeout)


@dataclass
class Parts:
    """The runtime(s) of the served model, the boundary finder, the canary and the traffic gate."""

    finder: SegmentFinder
    traffic: Traffic
    canary: Canary
    runtimes: Runtimes = field(default_factory=Runtimes)
    switching: threading.Lock = field(default_factory=threading.Lock)  # one model switch at a time (admin.model_switch)

    @classmethod
    def from_env(cls) -> "Parts":
        """The server's parts, configured from ``APC_*`` (a bad value stops the server here,
        while mlx-vlm's server module loads: before anything is served)."""
        traffic = Traffic()
        return cls(finder=SegmentFinder(SegmentSettings.from_env()), traffic=traffic,
                   canary=Canary.from_env(traffic))


SERVER_RUNTIME = "mlx_vlm.server.runtime"


def of_server() -> Parts | None:
    """The parts of the server built in this process (mlx-vlm's ``ServerRuntime.apc_parts``),
    or None where no server was built (a library caller of ``stream_generate``, a unit test):
    it is read, never built here, so a library caller never loads the server."""
    module = sys.modules.get(SERVER_RUNTIME)
    return getattr(getattr(module, "runtime", None), "apc_parts", None)
