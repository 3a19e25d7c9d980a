"""``apcctl serve``, ``stop`` and ``logs``: the patched server as a managed process."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import click

from apcctl import render
from apcctl.commands.common import (EXIT_CODES_HELP, EXIT_CODES_SHORT, CommandError, ExitStatus, Targets,
                                    emit_results, for_each, json_option, managed, one, server_options, talking_to)
from apcctl.config import DEFAULT_HOST, DEFAULT_PORT, ConfigError, Target, load_config
from apcctl.manage import ManagedServer, ManageError, build_spec


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.epilog = EXIT_CODES_HELP  # the codes hold for every server command, so 'apcctl --help' lists them
    for command in (serve, stop, logs):
        main.add_command(command)


@click.command(context_settings={"ignore_unknown_options": True}, epilog=EXIT_CODES_SHORT)
@click.option("--name", "-n", envvar="APCCTL_SERVER", default="default", show_default=True,
              help="Server name: its state files live in <state dir>/servers/NAME. [env: APCCTL_SERVER]")
@click.option("--model", "-m", metavar="DIR|REPO", help="Model to serve (default: the config's model).")
@click.option("--port", "-p", type=click.IntRange(1, 65535), help=f"Port (default: the config's, else {DEFAULT_PORT}).")
@click.option("--host", help=f"Interface to bind (default {DEFAULT_HOST}).")
@click.option("--disk-path", type=click.Path(file_okay=False, path_type=Path),
              help="Lineage disk tier directory (default: <server state dir>/lineage-disk).")
@click.option("--env", "-e", "env_pairs", multiple=True, metavar="KEY=VALUE",
              help="Extra environment for the server, e.g. -e APC_LINEAGE_RAM_BUDGET_BYTES=8000000000.")
@click.option("--foreground", is_flag=True,
              help="Run in this process (for launchd/systemd): same PID, output to the terminal.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until /health answers.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for /health.")
@click.option("--config", "config_path", envvar="APCCTL_CONFIG", type=click.Path(dir_okay=False, path_type=Path),
              help="TOML config file. [env: APCCTL_CONFIG]")
@json_option
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def serve(name: str, model: str | None, port: int | None, host: str | None, disk_path: Path | None,
          env_pairs: tuple[str, ...], foreground: bool, wait: bool, timeout: float, config_path: Path | None,
          as_json: bool, server_args: tuple[str, ...]) -> None:
    """Start the patched server in the background: PID file, log file and state under the state dir.

    Arguments after -- go to mlx-vlm's server unchanged. The server runs with APC_ENABLED=1,
    its own APC_STATE_DIR (admin token, journal) and its own disk tier.

    \b
    Examples:
      apcctl serve --model ~/models/glm5-next --port 8080
      apcctl serve --name b --model DIR --port 8081 -- --max-kv-size 65536
    """
    try:
        settings = load_config(config_path).servers.get(name)
        server = ManagedServer(name)
    except (ConfigError, ManageError) as exc:
        raise click.UsageError(str(exc)) from None
    model = model or (settings.model if settings else None)
    if not model:
        raise click.UsageError("--model is required (or set model= in the server's config table)")
    port = port or (settings.port if settings else None) or DEFAULT_PORT
    host = host or (settings.host if settings else None) or DEFAULT_HOST
    extra = (*(settings.args if settings else ()), *server_args)
    spec = build_spec(name, model=model, port=port, host=host, extra_args=extra, env=_env(env_pairs),
                      disk_path=disk_path)
    if server.pid() is not None:
        raise CommandError(f"server {name!r} is already running (pid {server.pid()}); apcctl stop --server {name}")
    if _port_busy(host, port):
        raise CommandError(f"port {port} on {host} is already in use")
    if foreground:
        server.exec_foreground(spec)
    pid = server.start(spec)
    if wait:
        try:
            server.wait_ready(timeout)
        except ManageError as exc:
            raise CommandError(str(exc)) from None
    info = {"server": name, "pid": pid, "url": spec.url, "log": str(server.log_path),
            "state_dir": str(server.directory), "ready": wait}
    if as_json:
        render.emit_json(info)
    else:
        click.echo(f"{name}: pid {pid} serving {spec.model} at {spec.url}" + ("" if wait else " (starting)"))
        click.echo(f"log {server.log_path}")


def _env(pairs: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--env")
        env[key] = value
    return env


def _port_busy(host: str, port: int) -> bool:
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((probe_host, port)) == 0


@click.command(epilog=EXIT_CODES_SHORT)
@server_options(allow_all=True)
@click.option("--grace", type=click.FloatRange(min=0),
              help="Seconds between SIGTERM (the server flushes its cache) and SIGKILL "
                   "(default: the server's shutdown flush timeout + a margin).")
@json_option
def stop(targets: Targets, grace: float | None, as_json: bool) -> None:
    """Stop a managed server: SIGTERM, then SIGKILL after the grace period."""

    def action(target: Target) -> dict:
        result = managed(target).stop(grace)
        return {"server": target.name, "pid": result.pid, "how": result.how}

    def show(results: list[dict]) -> None:
        if as_json:
            emit_results(targets, results)
            return
        for r in results:
            if "error" not in r:
                done = "not running" if r["pid"] is None else f"stopped pid {r['pid']} ({r['how']})"
                click.echo(f"{r['server']}: {done}")

    for_each(targets, action, show)


@click.command(epilog=EXIT_CODES_SHORT)
@server_options()
@click.option("--lines", "-n", type=click.IntRange(min=0), default=50, show_default=True, help="Lines to show.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing what the server writes (Ctrl-C stops).")
def logs(targets: list[Target], lines: int, follow: bool) -> None:
    """Show a managed server's log (uvicorn, the overlay and the apc_lineage lines)."""
    target = one(targets)
    with talking_to(target):
        server = managed(target)
    if not server.log_path.exists():
        raise CommandError(f"{target.name}: no log at {server.log_path} (a --foreground server writes to its "
                           "terminal or supervisor)", ExitStatus.NOT_FOUND)
    tail = server.log_tail(lines)
    if tail:
        click.echo(tail)
    if follow:
        _follow(server.log_path)


def _follow(path: Path, poll_s: float = 0.25) -> None:
    """``tail -f``: print appended bytes; start over when the file is rotated or truncated."""
    position = path.stat().st_size
    try:
        while True:
            size = path.stat().st_size if path.exists() else 0
            if size < position:
                position = 0
            if size > position:
                with path.open("rb") as f:
                    f.seek(position)
                    chunk = f.read(size - position)
                position = size
                click.echo(chunk.decode("utf-8", errors="replace"), nl=False)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        pass

