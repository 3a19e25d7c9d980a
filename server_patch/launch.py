"""Start mlx-vlm's server with the lineage patch: ``python -m server_patch.launch [server args]``.

The arguments are mlx-vlm 0.7.10's own (``mlx_vlm.server --help``). Differences from running
``python -m mlx_vlm.server``:

* the overlay is installed first (unless ``APC_LINEAGE=0``, which runs stock 0.7.10 with no
  overlay at all), so a patch that does not apply stops here with a message naming the file
  and the edit;
* ``--host`` defaults to 127.0.0.1 instead of mlx-vlm's 0.0.0.0;
* ``--reload`` is refused: uvicorn's reloader serves from a child process that would import
  mlx-vlm without the hook;
* with the lineage disk tier on, the disk directory is locked for the life of the process, so
  a second server on the same directory exits here with a message naming the holder's PID.

It works because ``mlx_vlm.server.cli.main`` parses ``sys.argv`` and then runs
``uvicorn.run("mlx_vlm.server:app", workers=1)`` in this same process, where the hook applies.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server_patch.disk.lock import DiskLock

DEFAULT_HOST = "127.0.0.1"

# Held until the process exits (the kernel drops the flock then, kill -9 included).
_DISK_LOCK: "DiskLock | None" = None


def lineage_enabled(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """``APC_LINEAGE=0`` (or false/no/off) turns the whole patch off."""
    return environ.get("APC_LINEAGE", "1").strip().lower() not in ("0", "false", "no", "off")


def server_argv(args: list[str]) -> list[str]:
    """The server's arguments with the loopback default applied."""
    if not any(arg == "--host" or arg.startswith("--host=") for arg in args):
        args = ["--host", DEFAULT_HOST, *args]
    return args


def check_config() -> None:
    """Reject a lineage configuration the server cannot honour before anything starts."""
    from server_patch.lineage import LineageConfig

    try:
        config = LineageConfig.from_env()
    except ValueError as exc:
        raise SystemExit(f"server_patch.launch: {exc}") from None
    if config.entry_offset != 1:
        raise SystemExit(
            "server_patch.launch: APC_LINEAGE_ENTRY_OFFSET must be 1 with mlx-vlm 0.7.10, which "
            "prefills tokens [:n-1] and has no state at n (other values are for the simulator)")


def lock_disk_root(environ: os._Environ[str] | dict[str, str] = os.environ) -> "DiskLock | None":
    """Hold the lineage disk directory for this process (None when the disk tier is off).

    Light imports only: this runs before the overlay is installed, i.e. before mlx-vlm loads.
    """
    from server_patch.disk.lock import DiskInUse, DiskLock
    from server_patch.disk.paths import default_disk_root, disk_enabled
    from server_patch.disk.space import min_free_from_env

    if not disk_enabled(environ):
        return None
    root = default_disk_root(environ)
    try:
        min_free_from_env(environ)
        lock = DiskLock(root).acquire()
        for path in lock.remove_leftovers():
            print(f"server_patch.launch: removed {path} (temp file left by an interrupted write)",
                  file=sys.stderr)
        return lock
    except (DiskInUse, ValueError) as exc:
        raise SystemExit(f"server_patch.launch: {exc}") from None
    except OSError as exc:
        raise SystemExit(f"server_patch.launch: cannot lock lineage disk directory {root}: {exc}") from None


def _end_streams_on_shutdown() -> None:
    """Tell /admin/events to end when uvicorn starts shutting down.

    uvicorn waits for every open connection before the lifespan shutdown runs; an event stream
    never ends by itself, so without this a SIGTERM would wait until SIGKILL and skip the
    shutdown flush. This wraps uvicorn's signal handler (uvicorn, not mlx-vlm).
    """
    if not lineage_enabled():
        return
    import uvicorn

    from server_patch.admin.traffic import TRAFFIC

    original = uvicorn.Server.handle_exit
    if getattr(original, "_apc_wrapped", False):
        return

    def handle_exit(self, sig, frame):  # type: ignore[no-untyped-def]
        TRAFFIC.shutting_down.set()
        return original(self, sig, frame)

    handle_exit._apc_wrapped = True  # type: ignore[attr-defined]
    uvicorn.Server.handle_exit = handle_exit


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--reload" in args:
        raise SystemExit("server_patch.launch: --reload is not supported (the reloader's child would run unpatched)")
    if lineage_enabled():
        check_config()
        global _DISK_LOCK
        _DISK_LOCK = lock_disk_root()
        from server_patch.overlay import PatchError, install

        try:
            finder = install()
        except PatchError as exc:
            raise SystemExit(f"server_patch.launch: {exc}") from exc
        edits = sum(len(p.edits) for p in finder.registry.values())
        print(
            f"server_patch.launch: overlay installed ({edits} edits in "
            f"{len(finder.registry)} mlx-vlm files)",
            file=sys.stderr,
        )
    else:
        print("server_patch.launch: APC_LINEAGE=0, running stock mlx-vlm", file=sys.stderr)
    _end_streams_on_shutdown()
    sys.argv = ["mlx_vlm.server", *server_argv(args)]
    from mlx_vlm.server.cli import main as server_main

    server_main()


if __name__ == "__main__":
    main()
