"""``apcctl service install|uninstall|status``: a managed server under launchd or systemd."""

from __future__ import annotations

from pathlib import Path

import click

from apcctl.commands.common import EXIT_CODES_SHORT, CommandError, ExitStatus, json_option
from apcctl.commands.complete import server_names
from apcctl.commands.serve import (PassThroughCommand, port_busy, server_args_given, server_spec, sizing_lines,
                                   spec_sizing)
from apcctl.config import ConfigError, load_config, server_name
from apcctl.core import render
from apcctl.core.manage import ManagedServer, ManageError
from apcctl.service import install as installer
from apcctl.service.ready import wait_healthy
from apcctl.service.record import read_record
from apcctl.service.runner import SupervisorError
from apcctl.service.units import ServiceConfigError, command_line

SERVER_OPTION = click.option("--server", "--name", "-s", "name", envvar="APCCTL_SERVER", metavar="NAME|URL",
                             shell_complete=server_names,
                             help="Server name (default: the config's default, its only server, else 'default'). "
                                  "[env: APCCTL_SERVER]")
SUPERVISOR_OPTION = click.option("--supervisor", type=click.Choice(installer.SUPERVISED),
                                 help="Default: launchd on macOS, systemd elsewhere (or what install recorded).")
CONFIG_OPTION = click.option("--config", "config_path", envvar="APCCTL_CONFIG",
                             type=click.Path(dir_okay=False, path_type=Path), help="TOML config file. [env: APCCTL_CONFIG]")


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(service)


@click.group()
def service() -> None:
    """Run a managed server under launchd (macOS) or a systemd user unit (Linux).

    The supervisor starts it at login, again after a crash, and gives its shutdown flush time
    to finish; apcctl restart of an installed server goes through it.
    """


@service.command("install", cls=PassThroughCommand, epilog=EXIT_CODES_SHORT)
@SERVER_OPTION
@click.option("--model", "-m", metavar="DIR|REPO", help="Model to serve (default: the config's model).")
@click.option("--port", "-p", type=click.IntRange(1, 65535), help="Port (default: the config's, else 8080).")
@click.option("--host", help="Interface to bind (default 127.0.0.1).")
@click.option("--disk-path", type=click.Path(file_okay=False, path_type=Path), help="Lineage disk tier directory.")
@click.option("--env", "-e", "env_pairs", multiple=True, metavar="KEY=VALUE", help="Extra environment for the server.")
@SUPERVISOR_OPTION
@CONFIG_OPTION
@click.option("--dry-run", is_flag=True, help="Print the plist or unit; install nothing.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until /health answers.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for /health.")
@json_option
def install(name: str | None, model: str | None, port: int | None, host: str | None, disk_path: Path | None,
            env_pairs: tuple[str, ...], supervisor: str | None, config_path: Path | None, dry_run: bool,
            wait: bool, timeout: float, as_json: bool) -> None:
    """Write and load a launchd agent or systemd user unit running `apcctl serve --foreground`.

    Takes serve's options. launchd: ~/Library/LaunchAgents/com.apcctl.NAME.plist, KeepAlive
    (again after a crash, not after a clean stop), ExitTimeOut = the shutdown flush + 15 s.
    systemd: ~/.config/systemd/user/apcctl-NAME.service, Restart=on-failure, TimeoutStopSec
    likewise, ready once /health answers. The server writes and rotates
    <state dir>/servers/NAME/server.log; service.log there has what came before.

    \b
    Examples:
      apcctl service install --server main --model ~/models/glm5-next --port 8080
      apcctl service install --server main --model DIR --dry-run
    """
    supervisor = supervisor or installer.default_supervisor()
    server_args = server_args_given() or ()  # only what follows -- reaches mlx-vlm, as for serve
    spec, server = server_spec(name, model, port, host, disk_path, env_pairs, config_path, server_args)
    try:
        unit = installer.service_spec(spec, config_path=config_path, disk_path=disk_path, env_pairs=env_pairs,
                                      server_args=server_args)
    except ServiceConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if dry_run:
        click.echo(installer.render(supervisor, unit).decode(), nl=False)
        return
    if read_record(spec.name) is None:  # a reinstall replaces the running service: its port is its own
        if server.pid() is not None:
            raise CommandError(f"server {spec.name!r} runs already, started by apcctl serve (pid {server.pid()}): "
                               f"apcctl stop --server {spec.name} first")
        if port_busy(spec.host, spec.port):
            raise CommandError(f"port {spec.port} on {spec.host} is already in use")
    sizing = spec_sizing(spec)
    try:
        done = installer.install(supervisor, unit)
    except (SupervisorError, OSError) as exc:
        hint = f"\n{installer.NO_USER_BUS_HINT}" if any(m in str(exc) for m in installer.NO_USER_BUS) else ""
        raise CommandError(f"{spec.name}: {exc}{hint}") from None
    if wait and not wait_healthy(unit.health_url, timeout):  # systemd's enable --now waited already
        raise CommandError(f"{spec.name}: installed, but {unit.health_url}/health did not answer within "
                           f"{timeout:.0f} s; see {unit.log_path} and {server.log_path}")
    info = {"server": spec.name, "supervisor": done.supervisor, "service": done.service, "file": str(done.path),
            "commands": [command_line(c) for c in done.commands], "log": str(server.log_path), "sizing": sizing}
    if as_json:
        render.emit_json(info)
        return
    click.echo(f"{spec.name}: {done.supervisor} service {done.service} installed and started ({done.path})")
    click.echo(f"log {server.log_path}; restart: apcctl restart --server {spec.name}; "
               f"remove: apcctl service uninstall --server {spec.name}")
    for line in sizing_lines(sizing):
        click.echo(line, err=line.startswith("warning"))


def _name(name: str | None, config_path: Path | None) -> str:
    try:
        resolved = server_name(name, load_config(config_path))
        ManagedServer(resolved)
    except (ConfigError, ManageError) as exc:
        raise click.UsageError(str(exc)) from None
    return resolved


@service.command("uninstall", epilog=EXIT_CODES_SHORT)
@SERVER_OPTION
@SUPERVISOR_OPTION
@CONFIG_OPTION
@json_option
def uninstall(name: str | None, supervisor: str | None, config_path: Path | None, as_json: bool) -> None:
    """Stop the service (its stop timeout covers the shutdown flush), unload it, remove its file."""
    name = _name(name, config_path)
    try:
        done = installer.uninstall(name, supervisor)
    except LookupError as exc:
        raise CommandError(str(exc), ExitStatus.NOT_FOUND) from None
    except SupervisorError as exc:
        raise CommandError(f"{name}: {exc}") from None
    if as_json:
        render.emit_json(done)
    else:
        click.echo(f"{name}: {done['supervisor']} service {done['service']} removed ({done['file']})"
                   + ("" if done["unloaded"] else "; it was not loaded"))


@service.command("status", epilog=EXIT_CODES_SHORT)
@SERVER_OPTION
@SUPERVISOR_OPTION
@CONFIG_OPTION
@json_option
def status(name: str | None, supervisor: str | None, config_path: Path | None, as_json: bool) -> None:
    """What launchd or systemd says of the service: loaded, state, PID, last exit code."""
    name = _name(name, config_path)
    try:
        info = installer.status(name, supervisor)
    except LookupError as exc:
        raise CommandError(str(exc), ExitStatus.NOT_FOUND) from None
    except SupervisorError as exc:
        raise CommandError(f"{name}: {exc}") from None
    if as_json:
        render.emit_json(info)
        return
    rows = [("service", f"{info['supervisor']} {info['service']}"), ("file", info["file"]),
            ("loaded", "yes" if info["loaded"] else "no"), ("state", str(info["state"] or "-")),
            ("pid", str(info["pid"] or "-")), ("last exit", str(info["last_exit_code"] or "-")), ("log", info["log"])]
    render.console().print(render.key_values(rows, title=f"[bold]{name}[/]"))
