"""Start mlx-vlm's server with the lineage patch: ``python -m server_patch.launch [server args]``.

The arguments are mlx-vlm 0.7.10's own (``mlx_vlm.server --help``). Differences from running
``python -m mlx_vlm.server``:

* the overlay is installed first (unless ``APC_LINEAGE=0``, which runs stock 0.7.10 with no
  overlay at all), so a patch that does not apply stops here with a message naming the file
  and the edit;
* ``--host`` defaults to 127.0.0.1 instead of mlx-vlm's 0.0.0.0;
* ``--reload`` is refused: uvicorn's reloader serves from a child process that would import
  mlx-vlm without the hook;
* with ``APC_LOG_FILE``, all output goes to that file, which rotates while the server runs
  (``APC_LOG_MAX_BYTES``, 64 MiB; ``APC_LOG_BACKUPS``, 4 old files);
* the budgets are printed at start, with a warning when the RAM budget exceeds physical memory
  or the disk cap exceeds the free space of its volume;
* with the lineage disk tier on, the disk directory is locked for the life of the process, so
  a second server on the same directory exits here with a message naming the holder's PID;
* ``--api-key KEY`` (repeatable) and ``--api-key-file FILE`` are the patch's inference API keys
  (``APC_API_KEYS``, ``APC_API_KEY_FILE``: each key its own cache namespace, ``/health`` open),
  not mlx-vlm's single ``--api-key`` (``server_patch.tenancy.flags``);
* ``--served-model-name NAME`` (vLLM's flag; ``APC_SERVED_MODEL_NAME``) and ``--allowed-origins
  ORIGIN`` (``APC_ALLOWED_ORIGINS``), repeatable or comma-separated, are the patch's: a request
  naming another model than ``--model`` gets 404, a web page of an unlisted origin gets 403
  (``server_patch.serving``);
* ``--allowed-local-media-path DIR`` (vLLM's flag; ``APC_ALLOWED_LOCAL_MEDIA_PATH``) lets requests
  name media files under DIR; without it no local path is read (``server_patch.intake.media``);
* ``--copy-counter[=FILE]`` (or ``APC_COPY_COUNTER=1``) installs the copy counter, for
  measurement only (``server_patch.copyfree.counter``; its totals as JSON in FILE), and is not
  passed on to mlx-vlm.

It works because ``mlx_vlm.server.cli.main`` parses ``sys.argv`` and then runs
``uvicorn.run("mlx_vlm.server:app", workers=1)`` in this same process, where the hook applies.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server_patch.disk.lock import DiskLock

DEFAULT_HOST = "127.0.0.1"

# Held until the process exits (the kernel drops the flock then, kill -9 included).
_DISK_LOCK: "DiskLock | None" = None


def lineage_enabled(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """``APC_LINEAGE=0`` (or false/no/off) turns the whole patch off; a value that is not a
    boolean stops the server with a message rather than guessing."""
    from server_patch import settings

    try:
        return bool(settings.value("APC_LINEAGE", environ))
    except ValueError as exc:
        raise SystemExit(f"server_patch.launch: {exc}") from None


COPY_COUNTER_FLAG = "--copy-counter"


def take_copy_counter(args: list[str]) -> tuple[list[str], bool, str | None]:
    """``args`` without ``--copy-counter[=FILE]``, whether it was given, and its FILE."""
    rest, wanted, file = [], False, None
    for arg in args:
        if arg == COPY_COUNTER_FLAG:
            wanted = True
        elif arg.startswith(COPY_COUNTER_FLAG + "="):
            wanted, file = True, arg.split("=", 1)[1] or None
        else:
            rest.append(arg)
    return rest, wanted, file


def server_argv(args: list[str]) -> list[str]:
    """The server's arguments with the loopback default applied."""
    if not any(arg == "--host" or arg.startswith("--host=") for arg in args):
        args = ["--host", DEFAULT_HOST, *args]
    return args


def check_config(args: list[str] | None = None) -> None:
    """Reject a lineage configuration (or a server option, TurboQuant ``--kv-bits``) the server
    cannot honour before anything starts."""
    from server_patch.lineage import LineageConfig
    from server_patch.state.options import UnsupportedCacheError, kv_quant_of

    try:
        config = LineageConfig.from_env()
        kv_quant = kv_quant_of(list(args or []), os.environ)  # TurboQuant is refused; uniform --kv-bits is served
    except (ValueError, UnsupportedCacheError) as exc:
        raise SystemExit(f"server_patch.launch: {exc}") from None
    if config.entry_offset != 1:
        raise SystemExit(
            "server_patch.launch: APC_LINEAGE_ENTRY_OFFSET must be 1 with mlx-vlm 0.7.10, which "
            "prefills tokens [:n-1] and has no state at n (other values are for the simulator)")
    from server_patch.speculative.support import check_drafter, draft_options, UnservedDrafter
    from server_patch.state.weights_hash import model_argument

    try:  # a drafter the lineage has not been proved with is refused (issue 39)
        served = check_drafter(model_argument(list(args or [])), draft_options(list(args or []), os.environ),
                               kv_bits=None if kv_quant is None else kv_quant.bits)
    except UnservedDrafter as exc:
        raise SystemExit(f"server_patch.launch: {exc}") from None
    if served is not None:
        from server_patch.speculative.support import SPECULATING_ENV

        os.environ[SPECULATING_ENV] = served  # the intake refuses logprobs it would get as 0.0


def warn_split_dependent(args: list[str]) -> None:
    """Say once at start when the model's own prefill depends on where a prompt is split
    (deepseek_v4, ``server_patch.state.splits``); the runtime says it at its first request
    for a model whose directory could not be read here (a Hub id)."""
    from server_patch.state.splits import model_type_of, warn_once
    from server_patch.state.weights_hash import model_argument

    warn_once(model_type_of(model_argument(args)),
              lambda text: print(f"server_patch.launch: WARNING: {text}", file=sys.stderr))


def lock_disk_root(environ: os._Environ[str] | dict[str, str] = os.environ) -> "DiskLock | None":
    """Hold the lineage disk directory for this process (None when the disk tier is off).

    Light imports only: this runs before the overlay is installed, i.e. before mlx-vlm loads.
    """
    from server_patch.disk.lock import DiskInUse, DiskLock
    from server_patch.disk_paths import default_disk_root, disk_enabled, shared_warning
    from server_patch.disk.space import min_free_from_env

    try:
        if not disk_enabled(environ):
            return None
        root = default_disk_root(environ)
        min_free_from_env(environ)
        if warning := shared_warning(environ):
            print(f"server_patch.launch: warning: {warning}", file=sys.stderr)
        lock = DiskLock(root).acquire()
        for path in lock.remove_leftovers():
            print(f"server_patch.launch: removed {path} (temp file left by an interrupted write)",
                  file=sys.stderr)
        return lock
    except (DiskInUse, ValueError) as exc:
        raise SystemExit(f"server_patch.launch: {exc}") from None
    except OSError as exc:
        raise SystemExit(f"server_patch.launch: cannot lock lineage disk directory {root}: {exc}") from None


LOG_FILE_ENV = "APC_LOG_FILE"
LOG_MAX_BYTES_ENV = "APC_LOG_MAX_BYTES"
LOG_BACKUPS_ENV = "APC_LOG_BACKUPS"
LOG_MAX_BYTES = 64 << 20
LOG_BACKUPS = 4


def rotate_files(path: Path, backups: int) -> None:
    """``path`` -> ``path.1`` -> ... -> ``path.<backups>`` (the oldest is dropped), like
    ``logging.handlers.RotatingFileHandler``; no backups: ``path`` is removed."""
    if backups <= 0:
        path.unlink(missing_ok=True)
        return
    for n in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
    if path.exists():
        os.replace(path, path.with_name(f"{path.name}.1"))


class RotatingOutput(io.TextIOBase):
    """The server's stdout and stderr when ``APC_LOG_FILE`` names a file: every write goes to it,
    and past ``max_bytes`` it rotates while the server runs.

    Python's logging (uvicorn's access and error logs included: their handlers write to
    ``sys.stdout``/``sys.stderr``), ``print`` and tracebacks pass through ``write``, which checks
    the size; file descriptors 1 and 2 are pointed at the current file after every rotation, so
    what C code (MLX, a fatal error) writes there lands in it too.
    """

    def __init__(self, path: Path, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS) -> None:
        super().__init__()
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self._lock = threading.RLock()
        self._open()

    def _open(self) -> None:
        from server_patch.private_files import open_private, private_dir

        private_dir(self.path.parent, tighten=False)  # a directory it creates is 0700; a configured one keeps its mode
        fd = open_private(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # 0600, an older 0644 file too
        try:
            for target in (1, 2):
                os.dup2(fd, target)
        finally:
            os.close(fd)

    def rollover(self) -> None:
        with self._lock:
            rotate_files(self.path, self.backups)
            self._open()

    encoding = "utf-8"
    errors = "backslashreplace"
    line_buffering = True

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def buffer(self) -> "_BinaryOutput":
        """For code that writes bytes to ``sys.stdout.buffer``."""
        return _BinaryOutput(self)

    def write(self, text: str) -> int:
        self.write_bytes(text.encode(self.encoding, errors=self.errors))
        return len(text)

    def write_bytes(self, data: bytes) -> int:
        with self._lock:
            if self.max_bytes > 0 and data:
                size = os.fstat(2).st_size
                if size > 0 and size + len(data) > self.max_bytes:
                    self.rollover()
            view = memoryview(data)
            while view:
                view = view[os.write(2, view):]
        return len(data)

    def fileno(self) -> int:
        return 2

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass  # every write is a system call already


class _BinaryOutput(io.RawIOBase):
    """``sys.stdout.buffer`` of a ``RotatingOutput``: bytes go through the same size check."""

    def __init__(self, output: RotatingOutput) -> None:
        super().__init__()
        self._output = output

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        return self._output.write_bytes(bytes(data))

    def fileno(self) -> int:
        return 2


def setup_log_file(environ: os._Environ[str] | dict[str, str] = os.environ) -> RotatingOutput | None:
    """With ``APC_LOG_FILE``, send all output there, rotating at ``APC_LOG_MAX_BYTES`` (64 MiB)
    with ``APC_LOG_BACKUPS`` (4) old files. Runs first, before any logging handler exists."""
    raw = environ.get(LOG_FILE_ENV, "").strip()
    if not raw:
        return None
    from server_patch import settings

    try:
        max_bytes = settings.value(LOG_MAX_BYTES_ENV, environ)
        backups = settings.value(LOG_BACKUPS_ENV, environ)
    except ValueError as exc:
        raise SystemExit(f"server_patch.launch: {exc}") from None
    if backups < 0:
        raise SystemExit(f"server_patch.launch: {LOG_BACKUPS_ENV} must be >= 0")
    sys.stdout.flush()
    sys.stderr.flush()
    output = RotatingOutput(Path(raw).expanduser(), max_bytes, backups)
    sys.stdout = sys.stderr = output  # type: ignore[assignment]
    return output


def warn_sizing() -> None:
    """Say at start when the budgets exceed what this machine has (RAM, the disk's free space)."""
    from server_patch.admin.views import human_size, sizing_view
    from server_patch.lineage import LineageConfig

    sizing = sizing_view(LineageConfig.from_env(), startup=True)
    b, disk = sizing["budgets"], sizing["disk"]
    where = (f"on {disk['path']} ({human_size(disk['free_bytes'])} free)" if disk.get("free_bytes") is not None
             else "(disk tier off)" if not disk["enabled"] else f"on {disk.get('path')}")
    print(f"server_patch.launch: budgets: RAM {human_size(b['ram_limit'])} (of {human_size(sizing['ram_total_bytes'])}"
          f" physical), anchors {b['anchor_count_limit']} / {human_size(b['anchor_bytes_limit'])}, "
          f"disk {human_size(b['disk_limit'])} {where}", file=sys.stderr)
    for warning in sizing["warnings"]:
        print(f"server_patch.launch: WARNING: {warning}", file=sys.stderr)


def _end_streams_on_shutdown() -> None:
    """Tell /admin/events to end when uvicorn starts shutting down.

    uvicorn waits for every open connection before the lifespan shutdown runs; an event stream
    never ends by itself, so without this a SIGTERM would wait until SIGKILL and skip the
    shutdown flush. This wraps uvicorn's signal handler (uvicorn, not mlx-vlm).
    """
    if not lineage_enabled():
        return
    import uvicorn

    from server_patch.integration.parts import of_server

    original = uvicorn.Server.handle_exit
    if getattr(original, "_apc_wrapped", False):
        return

    def handle_exit(self, sig, frame):  # type: ignore[no-untyped-def]
        parts = of_server()  # the server's traffic gate (built with mlx-vlm's server runtime)
        if parts is not None:
            parts.traffic.shutting_down.set()
        return original(self, sig, frame)

    handle_exit._apc_wrapped = True  # type: ignore[attr-defined]
    uvicorn.Server.handle_exit = handle_exit


def main(argv: list[str] | None = None) -> None:
    args, copy_counter, copy_counter_file = take_copy_counter(list(sys.argv[1:] if argv is None else argv))
    if "--reload" in args:
        raise SystemExit("server_patch.launch: --reload is not supported (the reloader's child would run unpatched)")
    setup_log_file()
    from server_patch.tenancy.flags import apply_api_key_flags

    args = apply_api_key_flags(args, os.environ, patched=lineage_enabled())  # keys never reach mlx-vlm's argv
    from server_patch.serving.flags import apply_serving_flags

    args = apply_serving_flags(args, os.environ, patched=lineage_enabled())
    from server_patch.intake.flags import apply_media_flag

    args = apply_media_flag(args, os.environ, patched=lineage_enabled())
    if lineage_enabled():
        check_config(args)
        warn_sizing()
        warn_split_dependent(args)
        global _DISK_LOCK
        _DISK_LOCK = lock_disk_root()
        from server_patch.disk.stock_home import stock_disk_env

        os.environ.update(stock_disk_env(os.environ))  # mlx-vlm's own tier: never ~/.cache with --disk-path
        if _DISK_LOCK is not None:  # the disk tier is keyed by every byte of the weights
            from server_patch.state.weights_hash import prehash

            prehash(args)
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
    from server_patch.copyfree import counter

    if copy_counter or counter.requested():  # measurement only: after the overlay, stock or patched
        counter.install(copy_counter_file)
    _end_streams_on_shutdown()
    from server_patch.admin.access_log import install as quiet_admin_reads

    try:
        quiet_admin_reads()  # the dashboard's polls out of the access log (APC_LOG_ADMIN_REQUESTS=1 keeps them)
    except ValueError as exc:
        raise SystemExit(f"server_patch.launch: {exc}") from None
    sys.argv = ["mlx_vlm.server", *server_argv(args)]
    from mlx_vlm.server.cli import main as server_main

    server_main()


if __name__ == "__main__":
    main()
