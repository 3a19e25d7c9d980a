"""Servers that ``apcctl serve`` runs: one directory per name, holding what a restart needs.

``<state dir>/servers/<name>/`` holds ``server.json`` (the command line and environment, so
``restart`` can start the same server again without the shell that first started it),
``server.running.json`` (the command the running process was started with: what a failed
restart rolls back to), ``server.pid`` (the PID on the first line, the process's create time on
the second: a PID alone may have been reused), ``server.log`` (written and rotated by the server
itself: ``APC_LOG_FILE``), and the server's own state (admin
token, journal, and by default the lineage disk tier), because the server runs with
``APC_STATE_DIR`` set to it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Mapping, NoReturn, Sequence

import psutil

from apcctl.core.client import AdminClient, AdminError
from server_patch.launch import LOG_BACKUPS, LOG_FILE_ENV, LOG_MAX_BYTES, rotate_files
from server_patch.lineage.config import LineageConfig
from server_patch.paths import state_dir
from server_patch.private_files import open_private, private_dir

SPEC_FILE = "server.json"
RUNNING_FILE = "server.running.json"
FAILED_FILE = "server.failed.json"
PID_FILE = "server.pid"
LOG_FILE = "server.log"
TOKEN_FILE = "admin-token"
START_BANNER = "=== apcctl "  # opens every start's part of server.log
LOG_ROTATE_BYTES = LOG_MAX_BYTES  # the server rotates server.log while it runs (APC_LOG_MAX_BYTES)
# Variables a server depends on, kept in server.json so a restart reproduces them.
ENV_PREFIXES = ("APC_", "HF_", "MLX_")
DEFAULT_ENV = {"APC_ENABLED": "1", "PYTHONUNBUFFERED": "1"}
# Set by ``build_spec`` for each server, whatever the shell says (its own state directory).
SERVER_OWN_ENV = ("APC_STATE_DIR",)
LAUNCHER = ("-m", "server_patch.launch")
# A systemd Type=notify unit sets NOTIFY_SOCKET; the readiness check beside the server sends READY=1 there.
NOTIFY_SOCKET = "NOTIFY_SOCKET"
READY_CHECK = ("-m", "apcctl.service.ready")
READY_TIMEOUT_S = 900  # model loading can take minutes on a big model
# On SIGTERM the server writes unwritten cache entries to disk for up to this long
# (LineageConfig.shutdown_flush_s, APC_LINEAGE_SHUTDOWN_FLUSH_S); a SIGKILL before then loses them.
SHUTDOWN_FLUSH_S = LineageConfig.shutdown_flush_s
# On top of the flush: uvicorn's own shutdown, the disk writer's join, releasing the model.
GRACE_MARGIN_S = 15.0
# psutil derives a Linux create time from the boot time, which a stepped clock can move by a
# second between two readers; a reused PID is never that close to the original's start.
CREATE_TIME_TOLERANCE_S = 1.0


class ManageError(RuntimeError):
    """A managed server could not be started or stopped; the message says why."""


def shutdown_flush_s(env: Mapping[str, str] | None = None) -> float:
    """The server's shutdown flush timeout, read the way the server reads it (``LineageConfig``)."""
    try:
        config = LineageConfig.from_env(dict(env or {}))
    except ValueError:
        config = LineageConfig()
    return float(config.shutdown_flush_s)


def default_grace(env: Mapping[str, str] | None = None) -> float:
    """SIGTERM to SIGKILL: long enough for the shutdown flush of a server started with ``env``."""
    return shutdown_flush_s(env) + GRACE_MARGIN_S


def same_process(process: psutil.Process, create_time: float) -> bool:
    """``process`` is the one that was created at ``create_time`` (not a later owner of its PID)."""
    try:
        return abs(process.create_time() - create_time) <= CREATE_TIME_TOLERANCE_S
    except psutil.Error:
        return False


def plain_name(name: object) -> bool:
    """A server or fleet name that is one directory under its root: not empty, no ``/``, not
    hidden (so it can never reach outside the root or collide with a lock or temp file)."""
    return isinstance(name, str) and bool(name) and "/" not in name and not name.startswith(".")


def servers_root() -> Path:
    return state_dir() / "servers"


def managed_names() -> list[str]:
    """Names of servers ``apcctl serve`` has started at least once."""
    root = servers_root()
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob(f"*/{SPEC_FILE}"))


@dataclass
class ServerSpec:
    """How to start one server again: written by ``serve``, read by ``restart`` and ``status``."""

    name: str
    host: str
    port: int
    model: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    # The part of ``env`` the config table gave (its budget keys): what a restart reads again.
    config_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def extra_args(self) -> list[str]:
        """The arguments for mlx-vlm after ``build_spec``'s ``--model/--host/--port``."""
        return self.argv[self.argv.index("--port") + 2:] if "--port" in self.argv else []


def rebased(spec: ServerSpec, *, port: int | None = None, host: str | None = None, disk_path: Path | None = None,
            extra_args: tuple[str, ...] | None = None) -> ServerSpec:
    """``spec`` with another port, host, disk tier or mlx-vlm arguments (None keeps each): what
    ``apcctl serve`` of a recorded server starts when flags are given again."""
    if port is None and host is None and disk_path is None and extra_args is None:
        return spec
    host, port = host or spec.host, port or spec.port
    head = spec.argv[:spec.argv.index("--model")] if "--model" in spec.argv else [sys.executable, *LAUNCHER]
    extra = list(extra_args) if extra_args is not None else spec.extra_args
    argv = [*head, "--model", spec.model, "--host", host, "--port", str(port), *extra]
    env = dict(spec.env)
    if disk_path is not None:
        env["APC_LINEAGE_DISK_PATH"] = str(Path(disk_path).expanduser().resolve())
    if (argv, env) == (spec.argv, spec.env):
        return spec
    return replace(spec, host=host, port=port, argv=argv, env=env, created=time.time())


def build_spec(name: str, *, model: str, port: int, host: str = "127.0.0.1", extra_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None, disk_path: Path | None = None,
               directory: Path | None = None, config_env: dict[str, str] | None = None) -> ServerSpec:
    """The command line and environment of a managed server (nothing is started)."""
    directory = directory or servers_root() / name
    environment = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    for key, value in DEFAULT_ENV.items():
        environment.setdefault(key, value)
    environment.update({key: str(directory) for key in SERVER_OWN_ENV})
    if disk_path is not None:
        environment["APC_LINEAGE_DISK_PATH"] = str(Path(disk_path).expanduser().resolve())
    else:
        # Two servers must never share a disk tier: each rebuilds its index from the files.
        environment.setdefault("APC_LINEAGE_DISK_PATH", str(directory / "lineage-disk"))
    environment.update(env or {})
    model_arg = str(Path(model).expanduser().resolve()) if Path(model).expanduser().exists() else model
    argv = [sys.executable, *LAUNCHER, "--model", model_arg, "--host", host, "--port", str(port), *extra_args]
    return ServerSpec(name=name, host=host, port=port, model=model_arg, argv=argv, env=environment,
                      config_env=dict(config_env or {}))


@dataclass(frozen=True)
class StopResult:
    pid: int | None
    how: str  # "not running", "SIGTERM", "SIGKILL"


class BackgroundFiles:
    """A process apcctl starts in the background: its PID file and log in ``directory``."""

    pid_file, log_file = PID_FILE, LOG_FILE

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def pid_path(self) -> Path:
        return self.directory / self.pid_file

    @property
    def log_path(self) -> Path:
        return self.directory / self.log_file

    def log_tail(self, lines: int = 40) -> str:
        return file_tail(self.log_path, lines)

    def cause(self) -> str:
        """``: <the exception line>`` of a start that failed (``failure_cause``), else ""."""
        found = failure_cause(file_tail(self.log_path, 2000))
        return f": {found}" if found else ""

    def open_log(self, what: str, argv: Sequence[str]) -> BinaryIO:
        """The log, opened for the child's output, after rotating it past its cap (at start too,
        so the banner line is not what pushes a full log past it) and a banner naming the start."""
        try:
            if self.log_path.stat().st_size > LOG_ROTATE_BYTES:
                rotate_files(self.log_path, LOG_BACKUPS)
        except FileNotFoundError:
            pass
        private_dir(self.directory)  # 0700: the log holds request ids, sizes and client text
        log = os.fdopen(open_private(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")  # 0600
        log.write(f"\n{START_BANNER}{what} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(argv)}\n".encode())
        log.flush()
        return log


class ManagedServer(BackgroundFiles):
    """The files of one managed server, and the verbs on its process."""

    def __init__(self, name: str, root: Path | None = None) -> None:
        if not plain_name(name):
            raise ManageError(f"bad server name {name!r}")
        self.name = name
        super().__init__((root or servers_root()) / name)

    @property
    def spec_path(self) -> Path:
        return self.directory / SPEC_FILE

    @property
    def token_path(self) -> Path:
        return self.directory / TOKEN_FILE

    @property
    def journal_dir(self) -> Path:
        spec = self.spec()
        configured = spec.env.get("APC_JOURNAL_DIR") if spec else None
        return Path(configured) if configured else self.directory / "journal"

    # ------------------------------------------------------------------ files

    def spec(self) -> ServerSpec | None:
        """The command the next start uses."""
        return _read_spec(self.spec_path)

    def running_spec(self) -> ServerSpec | None:
        """The command the running (or last started) process was started with."""
        return _read_spec(self.directory / RUNNING_FILE) or self.spec()

    def keep_failed(self, spec: ServerSpec) -> Path:
        """Keep a command that failed to start, for the operator to read, before a rollback."""
        path = self.directory / FAILED_FILE
        write_private(path, json.dumps(asdict(spec), indent=2))
        return path

    def save(self, spec: ServerSpec) -> None:
        """Owner-only, because the environment may hold the admin token."""
        private_dir(self.directory)
        write_private(self.spec_path, json.dumps(asdict(spec), indent=2))

    RECORD_FILES = (SPEC_FILE, RUNNING_FILE, FAILED_FILE, PID_FILE)

    def forget(self) -> list[Path]:
        """Remove the record (command, PID file): the name is no longer known to any command.
        The server's own state (log, token, journal, disk tier) stays; returns what was removed."""
        if self.pid() is not None:
            raise ManageError(f"server {self.name!r} is running (pid {self.pid()}): apcctl stop --server "
                              f"{self.name} first")
        removed = [self.directory / f for f in self.RECORD_FILES if (self.directory / f).exists()]
        for path in removed:
            path.unlink(missing_ok=True)
        return removed

    def discard_start(self, previous: ServerSpec | None) -> None:
        """A start that never came up: the record goes back to ``previous`` (the command that
        last ran), or is removed when there was none, so no command talks to a ghost."""
        self.stop(grace=10.0)
        if previous is not None:
            self.save(previous)
            return
        for name in (SPEC_FILE, RUNNING_FILE, PID_FILE):
            (self.directory / name).unlink(missing_ok=True)

    def token(self) -> str | None:
        spec = self.spec()
        if spec is not None and spec.env.get("APC_ADMIN_TOKEN"):
            return spec.env["APC_ADMIN_TOKEN"].strip()
        try:
            return self.token_path.read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def pid(self) -> int | None:
        """The PID in the PID file, if that process is alive and is a patched server."""
        process = self.process()
        return process.pid if process is not None else None

    def process(self) -> psutil.Process | None:
        """The process of the PID file: same PID and same create time, alive, not a zombie.

        A PID file without a create time (written by an older apcctl) is trusted only for a
        process running the launcher that was created before the file was written.
        """
        owner = pid_file_owner(self.pid_path)
        if owner is None:
            return None
        process, create_time = owner
        if create_time is not None:
            return process if same_process(process, create_time) else None
        try:
            if process.create_time() > self.pid_path.stat().st_mtime + CREATE_TIME_TOLERANCE_S:
                return None  # started after the PID file: the PID was reused
            return process if " ".join(LAUNCHER) in " ".join(process.cmdline()) else None
        except (OSError, psutil.Error):
            return None

    # ------------------------------------------------------------------ verbs

    def start(self, spec: ServerSpec) -> int:
        """Start in the background (own session, output to the log); returns the PID."""
        if self.pid() is not None:
            raise ManageError(f"server {self.name!r} is already running (pid {self.pid()})")
        self.save(spec)
        # The server writes its own log and rotates it while it runs (server_patch.launch);
        # always server.log, the file apcctl logs reads.
        env = {**os.environ, **spec.env, LOG_FILE_ENV: str(self.log_path)}
        with self.open_log(f"serve {self.name}", spec.argv) as log:
            process = subprocess.Popen(spec.argv, env=env, cwd=self.directory, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._write_pid(process.pid, spec)
        return process.pid

    def exec_foreground(self, spec: ServerSpec) -> NoReturn:
        """Become the server (same PID), so launchd/systemd supervise the real process. Under a
        ``Type=notify`` unit, a readiness check started first tells systemd ``READY=1``."""
        self.save(spec)
        self._write_pid(os.getpid(), spec)
        os.chdir(self.directory)
        env = {**os.environ, **spec.env}
        if env.pop(NOTIFY_SOCKET, None):  # the server itself does not notify: the check beside it does
            subprocess.Popen([sys.executable, *READY_CHECK, spec.url, str(READY_TIMEOUT_S)], stdin=subprocess.DEVNULL)
        os.execve(spec.argv[0], spec.argv, env)

    def _write_pid(self, pid: int, spec: ServerSpec) -> None:
        """The PID and its create time, and the command it runs (what a rollback starts again)."""
        write_private(self.directory / RUNNING_FILE, json.dumps(asdict(spec), indent=2))
        write_pid_file(self.pid_path, pid)

    def grace(self) -> float:
        """The default SIGTERM-to-SIGKILL time for this server's shutdown flush."""
        spec = self.running_spec()
        return default_grace(spec.env if spec else None)

    def stop(self, grace: float | None = None) -> StopResult:
        """SIGTERM (the server flushes its cache to disk), then SIGKILL after ``grace`` seconds
        (default: the server's shutdown flush timeout plus a margin)."""
        return stop_recorded(self.pid_path, self.process(), self.grace() if grace is None else grace)

    def wait_ready(self, timeout: float = 120.0, token: str | None = None) -> None:
        """Wait until ``/health`` answers; fail early, with the log, if the process exits."""
        spec = self.spec()
        if spec is None:
            raise ManageError(f"server {self.name!r} has no {SPEC_FILE}")
        client = AdminClient(spec.url, token, timeout=2.0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process() is None:
                raise ManageError(f"server {self.name!r} exited during start-up{self.cause()}; log tail:\n"
                                  f"{self.log_tail(20)}")
            try:
                client.health()
                return
            except AdminError:
                time.sleep(0.2)
        raise ManageError(f"server {self.name!r} did not answer /health within {timeout:.0f} s")



# The line a Python traceback ends with: ``FileNotFoundError: No safetensors found in ...``.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?::(?:\s.*)?)?$")


def failure_cause(log: str) -> str:
    """The exception a server that exited while starting died of: the last traceback's last
    line in ``log`` (its last start only), or "" when there is none. mlx-vlm may print its usage
    text after it, so the log's tail alone often hides it (issue 36)."""
    last_start = log.rfind(START_BANNER)
    lines = [line.strip() for line in log[last_start if last_start >= 0 else 0:].splitlines()]
    at = next((i for i in range(len(lines) - 1, -1, -1) if _EXCEPTION_LINE.match(lines[i])), None)
    if at is None:
        return ""
    if lines[at].endswith(":"):  # a message that starts on the next line (mlx-vlm's "No safetensors")
        following = next((line for line in lines[at + 1:] if line), "")
        return f"{lines[at]} {following}".strip()
    return lines[at]


def file_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a log (read from its last 256 KiB; "" if it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:]) if lines else ""


def _read_spec(path: Path) -> ServerSpec | None:
    try:
        return ServerSpec(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def write_pid_file(path: Path, pid: int) -> None:
    """The PID and its create time (together they name the process, whatever reuses the PID)."""
    try:
        created = f"{psutil.Process(pid).create_time()!r}\n"
    except psutil.Error:
        created = ""  # it exited already: nothing will match the file either way
    write_private(path, f"{pid}\n{created}")


def pid_file_owner(path: Path) -> tuple[psutil.Process, float | None] | None:
    """The live (not zombie) process a PID file names, with the create time the file records
    (None in files of older versions); None when there is no such process."""
    try:
        pid, created = parse_pid_file(path.read_text())
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process, created
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def stop_recorded(pid_path: Path, process: psutil.Process | None, grace: float) -> StopResult:
    """Stop the process a PID file named (``terminate``) and remove the file."""
    if process is None:
        pid_path.unlink(missing_ok=True)
        return StopResult(None, "not running")
    how = terminate(process, grace)
    pid_path.unlink(missing_ok=True)
    return StopResult(process.pid, how)


def parse_pid_file(text: str) -> tuple[int, float | None]:
    """``PID`` on the first line, and the create time on the second (absent in old files)."""
    lines = text.split()
    return int(lines[0]), (float(lines[1]) if len(lines) > 1 else None)


def terminate(process: psutil.Process, grace: float) -> str:
    """SIGTERM, then SIGKILL if it still runs after ``grace`` seconds (``psutil.wait_procs``: it
    tells a process that exited from a reused PID); returns the last signal."""
    try:
        process.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        return "SIGTERM"
    _, alive = psutil.wait_procs([process], timeout=grace)
    if not alive:
        return "SIGTERM"
    for survivor in alive:
        try:
            survivor.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    return "SIGKILL"


def write_private(path: Path, text: str) -> None:
    """Write ``path`` with mode 0600 (whatever the umask) through a temporary file and an
    atomic rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
