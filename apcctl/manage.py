"""Servers that ``apcctl serve`` runs: one directory per name, holding what a restart needs.

``<state dir>/servers/<name>/`` holds ``server.json`` (the command line and environment, so
``restart`` can start the same server again without the shell that first started it),
``server.pid``, ``server.log``, and the server's own state (admin token, journal, and by
default the lineage disk tier), because the server runs with ``APC_STATE_DIR`` set to it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NoReturn

import psutil

from apcctl.client import AdminClient, AdminError
from server_patch.paths import state_dir

SPEC_FILE = "server.json"
PID_FILE = "server.pid"
LOG_FILE = "server.log"
TOKEN_FILE = "admin-token"
LOG_ROTATE_BYTES = 64 * 1024 * 1024
# Variables a server depends on, kept in server.json so a restart reproduces them.
ENV_PREFIXES = ("APC_", "HF_", "MLX_")
DEFAULT_ENV = {"APC_ENABLED": "1", "PYTHONUNBUFFERED": "1"}
LAUNCHER = ("-m", "server_patch.launch")


class ManageError(RuntimeError):
    """A managed server could not be started or stopped; the message says why."""


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

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def build_spec(name: str, *, model: str, port: int, host: str = "127.0.0.1", extra_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None, disk_path: Path | None = None,
               directory: Path | None = None) -> ServerSpec:
    """The command line and environment of a managed server (nothing is started)."""
    directory = directory or servers_root() / name
    environment = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    for key, value in DEFAULT_ENV.items():
        environment.setdefault(key, value)
    environment["APC_STATE_DIR"] = str(directory)
    if disk_path is not None:
        environment["APC_LINEAGE_DISK_PATH"] = str(Path(disk_path).expanduser().resolve())
    else:
        # Two servers must never share a disk tier: each rebuilds its index from the files.
        environment.setdefault("APC_LINEAGE_DISK_PATH", str(directory / "lineage-disk"))
    environment.update(env or {})
    model_arg = str(Path(model).expanduser().resolve()) if Path(model).expanduser().exists() else model
    argv = [sys.executable, *LAUNCHER, "--model", model_arg, "--host", host, "--port", str(port), *extra_args]
    return ServerSpec(name=name, host=host, port=port, model=model_arg, argv=argv, env=environment)


@dataclass(frozen=True)
class StopResult:
    pid: int | None
    how: str  # "not running", "SIGTERM", "SIGKILL"


class ManagedServer:
    """The files of one managed server, and the verbs on its process."""

    def __init__(self, name: str, root: Path | None = None) -> None:
        if not name or "/" in name or name.startswith("."):
            raise ManageError(f"bad server name {name!r}")
        self.name = name
        self.directory = (root or servers_root()) / name

    @property
    def spec_path(self) -> Path:
        return self.directory / SPEC_FILE

    @property
    def pid_path(self) -> Path:
        return self.directory / PID_FILE

    @property
    def log_path(self) -> Path:
        return self.directory / LOG_FILE

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
        try:
            return ServerSpec(**json.loads(self.spec_path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None

    def save(self, spec: ServerSpec) -> None:
        """Owner-only, because the environment may hold the admin token."""
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_private(self.spec_path, json.dumps(asdict(spec), indent=2))

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
        try:
            pid = int(self.pid_path.read_text().split()[0])
            process = psutil.Process(pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return None
            if "server_patch.launch" not in " ".join(process.cmdline()):
                return None  # the PID was reused by something else
            return process
        except (OSError, ValueError, IndexError, psutil.Error):
            return None

    # ------------------------------------------------------------------ verbs

    def start(self, spec: ServerSpec) -> int:
        """Start in the background (own session, output to the log); returns the PID."""
        if self.pid() is not None:
            raise ManageError(f"server {self.name!r} is already running (pid {self.pid()})")
        self.save(spec)
        self._rotate_log()
        env = {**os.environ, **spec.env}
        with self.log_path.open("ab") as log:
            log.write(f"\n=== apcctl serve {self.name} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                      f"{' '.join(spec.argv)}\n".encode())
            log.flush()
            process = subprocess.Popen(spec.argv, env=env, cwd=self.directory, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _write_private(self.pid_path, f"{process.pid}\n")
        _wait_exec(process)
        return process.pid

    def exec_foreground(self, spec: ServerSpec) -> NoReturn:
        """Become the server (same PID), so launchd/systemd supervise the real process."""
        self.save(spec)
        _write_private(self.pid_path, f"{os.getpid()}\n")
        os.chdir(self.directory)
        os.execve(spec.argv[0], spec.argv, {**os.environ, **spec.env})

    def stop(self, grace: float = 20.0) -> StopResult:
        """SIGTERM (the server flushes its cache to disk), then SIGKILL after ``grace`` seconds."""
        process = self.process()
        if process is None:
            self.pid_path.unlink(missing_ok=True)
            return StopResult(None, "not running")
        how = terminate(process, grace)
        self.pid_path.unlink(missing_ok=True)
        return StopResult(process.pid, how)

    def wait_ready(self, timeout: float = 120.0, token: str | None = None) -> None:
        """Wait until ``/health`` answers; fail early, with the log, if the process exits."""
        spec = self.spec()
        if spec is None:
            raise ManageError(f"server {self.name!r} has no {SPEC_FILE}")
        client = AdminClient(spec.url, token, timeout=2.0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process() is None:
                raise ManageError(f"server {self.name!r} exited during start-up; log tail:\n{self.log_tail(20)}")
            try:
                client.health()
                return
            except AdminError:
                time.sleep(0.2)
        raise ManageError(f"server {self.name!r} did not answer /health within {timeout:.0f} s")

    def log_tail(self, lines: int = 40) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:]) if lines else ""

    def _rotate_log(self) -> None:
        try:
            if self.log_path.stat().st_size > LOG_ROTATE_BYTES:
                os.replace(self.log_path, self.log_path.with_name(LOG_FILE + ".1"))
        except FileNotFoundError:
            pass


def _wait_exec(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Return once the child has exec'd the launcher (before that, its command line is ours and
    ``ManagedServer.process`` would not recognise it) or has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if "server_patch.launch" in " ".join(psutil.Process(process.pid).cmdline()):
                return
        except psutil.Error:
            pass
        time.sleep(0.01)


def terminate(process: psutil.Process, grace: float) -> str:
    """SIGTERM, then SIGKILL if it still runs after ``grace`` seconds; returns the last signal."""
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=grace)
    except psutil.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
        return "SIGKILL"
    except psutil.NoSuchProcess:
        pass
    return "SIGTERM"


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` with mode 0600 through a temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
