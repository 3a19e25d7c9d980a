"""Install, remove and inspect a supervised server: files from ``units``, commands through
``runner``, the supervisor recorded for ``restart`` in ``record``."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from apcctl.core.manage import ENV_PREFIXES, ServerSpec, default_grace, servers_root
from apcctl.service import units
from apcctl.service.record import ServiceRecord, read_record, remove_record, write_record
from apcctl.service.runner import SupervisorError, run_supervisor
from server_patch.launch import LOG_FILE_ENV
from server_patch.private_files import open_private, private_dir

SUPERVISED = ("launchd", "systemd")
# The per-user dirs platformdirs reads on Linux: the state dir (servers' records), the config file.
XDG_DIRS = ("XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME")
# What systemctl --user says when this login has no user manager to talk to.
NO_USER_BUS = ("Failed to connect to bus", "No medium found", "DBUS_SESSION_BUS_ADDRESS")
NO_USER_BUS_HINT = ("there is no systemd user session here (no user bus): log in through a desktop or ssh "
                    "session, or run `loginctl enable-linger $USER` and log in again; or print the unit with "
                    "--dry-run and install it yourself")


def default_supervisor(platform: str = sys.platform) -> str:
    return "launchd" if platform == "darwin" else "systemd"


def service_environment(name: str, config_path: Path | None) -> dict[str, str]:
    """What ``apcctl serve --foreground`` needs from this shell: the ``APC_*``/``HF_*``/``MLX_*``
    variables (``APC_STATE_DIR`` among them: where the server's files are), the XDG dirs it
    sets (without them the service would keep its state and read its config elsewhere than
    this shell), the config file, and the log file the server writes and rotates itself."""
    env = {k: v for k, v in os.environ.items()
           if (k.startswith(ENV_PREFIXES) or k in XDG_DIRS) and k != LOG_FILE_ENV}
    env.update({"PYTHONUNBUFFERED": "1", LOG_FILE_ENV: str(servers_root() / name / "server.log")})
    if config_path is not None:
        env["APCCTL_CONFIG"] = str(Path(config_path).expanduser().resolve())
    return env


def serve_argv(spec: ServerSpec, *, disk_path: Path | None, env_pairs: tuple[str, ...],
               server_args: tuple[str, ...]) -> list[str]:
    """``python -m apcctl.cli serve --foreground ...`` with every choice made explicit, so the
    supervisor starts what was installed (the config file is still read at every start)."""
    argv = [sys.executable, "-m", "apcctl.cli", "serve", "--foreground", "--server", spec.name,
            "--model", spec.model, "--port", str(spec.port), "--host", spec.host]
    if disk_path is not None:
        argv += ["--disk-path", str(Path(disk_path).expanduser().resolve())]
    for pair in env_pairs:
        argv += ["-e", pair]
    return argv + (["--", *server_args] if server_args else [])


def service_spec(spec: ServerSpec, *, config_path: Path | None, disk_path: Path | None,
                 env_pairs: tuple[str, ...], server_args: tuple[str, ...]) -> units.ServiceSpec:
    """The supervised form of the server ``serve`` would start with the same options."""
    directory = servers_root() / spec.name
    host = "127.0.0.1" if spec.host in ("0.0.0.0", "::", "") else spec.host
    return units.ServiceSpec(
        name=spec.name, argv=tuple(serve_argv(spec, disk_path=disk_path, env_pairs=env_pairs, server_args=server_args)),
        env=service_environment(spec.name, config_path), working_dir=directory,
        log_path=directory / units.SERVICE_LOG, stop_timeout_s=default_grace(spec.env),
        health_url=f"http://{host}:{spec.port}")


def render(supervisor: str, spec: units.ServiceSpec) -> bytes:
    if supervisor == "launchd":
        return units.launchd_plist(spec)
    return units.systemd_unit(spec).encode()


@dataclass(frozen=True)
class Installed:
    supervisor: str
    service: str
    path: Path
    commands: list[list[str]]


def install(supervisor: str, spec: units.ServiceSpec) -> Installed:
    """Write the file (0600: the environment may hold a token), record the supervisor, load it.
    A load that fails removes both again, so ``restart`` never goes to a service that is not there."""
    path = units.unit_path(supervisor, spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    private_dir(spec.working_dir)  # 0700: server.log and the supervisor's capture live there
    if Path(spec.log_path).parent == Path(spec.working_dir):  # the capture file: 0600 before the supervisor opens it
        os.close(open_private(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(render(supervisor, spec))
    os.replace(tmp, path)
    service = units.service_id(supervisor, spec.name)
    write_record(spec.name, ServiceRecord(supervisor, service, str(path)))
    if supervisor == "launchd":
        first, *rest = units.launchd_install_commands(spec, path)
        run_supervisor(first, check=False)  # unload an older copy; fails when none is loaded
        commands = [first, *rest]
    else:
        rest = commands = units.systemd_install_commands(spec.name)
    try:
        for argv in rest:
            _run_retrying(argv, attempts=5 if supervisor == "launchd" else 1)
    except SupervisorError:
        remove_record(spec.name)
        path.unlink(missing_ok=True)
        raise
    return Installed(supervisor, service, path, commands)


def _run_retrying(argv: list[str], attempts: int, pause_s: float = 1.0) -> None:
    """launchd may still be tearing down the copy ``bootout`` removed: ``bootstrap`` then fails
    with an I/O error for a moment, so it is tried again a few times."""
    for attempt in range(attempts):
        try:
            run_supervisor(argv)
            return
        except SupervisorError:
            if attempt == attempts - 1:
                raise
            time.sleep(pause_s)


def uninstall(name: str, supervisor: str | None = None) -> dict[str, Any]:
    """Stop and unload the service (the supervisor gives it its stop timeout), remove its file
    and the record. Returns what was done; nothing installed is a ``LookupError``."""
    record = read_record(name)
    supervisor = supervisor or (record.supervisor if record else default_supervisor())
    path = Path(record.path) if record else units.unit_path(supervisor, name)
    if record is None and not path.exists():
        raise LookupError(f"no {supervisor} service is installed for server {name!r} ({path} does not exist)")
    commands = (units.launchd_uninstall_commands(name) if supervisor == "launchd"
                else units.systemd_uninstall_commands(name))
    outcomes = [run_supervisor(argv, check=False) for argv in commands]
    path.unlink(missing_ok=True)
    if supervisor == "systemd":
        run_supervisor(["systemctl", "--user", "daemon-reload"], check=False)
    remove_record(name)
    return {"server": name, "supervisor": supervisor, "service": units.service_id(supervisor, name),
            "file": str(path), "unloaded": all(o.returncode == 0 for o in outcomes)}


def status(name: str, supervisor: str | None = None) -> dict[str, Any]:
    """What the supervisor says of the service (``launchctl print`` / ``systemctl show``)."""
    record = read_record(name)
    supervisor = supervisor or (record.supervisor if record else default_supervisor())
    path = Path(record.path) if record else units.unit_path(supervisor, name)
    if record is None and not path.exists():
        raise LookupError(f"no {supervisor} service is installed for server {name!r} ({path} does not exist)")
    if supervisor == "launchd":
        outcome = run_supervisor(units.launchd_status_command(name), check=False)
        state = units.parse_launchd_print(outcome.stdout) if outcome.returncode == 0 else {}
        loaded = outcome.returncode == 0
    else:
        outcome = run_supervisor(units.systemd_status_command(name), check=False)
        state = units.parse_systemctl_show(outcome.stdout) if outcome.returncode == 0 else {}
        loaded = state.get("load_state") == "loaded"
    return {"server": name, "supervisor": supervisor, "service": units.service_id(supervisor, name),
            "file": str(path), "installed": path.exists(), "recorded": record is not None, "loaded": loaded,
            "state": state.get("state"), "pid": state.get("pid"), "last_exit_code": state.get("last_exit_code"),
            "log": str(servers_root() / name / "server.log")}
