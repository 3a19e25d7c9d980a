"""``apcctl serve``, ``stop`` and ``logs``: the patched server as a managed process."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable

import click

from apcctl.commands.common import (EXIT_CODES_HELP, EXIT_CODES_SHORT, CommandError, Targets, emit_results,
                                    for_each, json_option, managed, server_options)
from apcctl.commands.complete import server_names
from apcctl.config import DEFAULT_HOST, DEFAULT_PORT, ConfigError, Target, load_config, server_name
from apcctl.core import render
from apcctl.core.hosts import port_busy
from apcctl.core.manage import (ENV_PREFIXES, SERVER_OWN_ENV, ManagedServer, ManageError, ServerSpec, build_spec,
                                rebased)
from apcctl.core.model_source import model_problem, weights_problem
from apcctl.core.respec import Changes, difference, override_notes, respec, shown
from apcctl.service.record import read_record

if TYPE_CHECKING:
    from server_patch.admin.schema import Sizing


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.epilog = EXIT_CODES_HELP  # the codes hold for every server command, so 'apcctl --help' lists them
    for command in (serve, stop):  # logs: commands.ops
        main.add_command(command)


class PassThroughCommand(click.Command):
    """A command whose arguments after ``--`` go to mlx-vlm's server unchanged (in
    ``ctx.meta[SERVER_ARGS]``; None without ``--``); everything before is click's, so a
    mistyped option (``--prot``) is an error at once, with click's suggestion, not mlx-vlm's
    usage text from a server that exits seconds later."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            at = args.index("--")
            args, ctx.meta[SERVER_ARGS] = args[:at], tuple(args[at + 1:])
        else:
            ctx.meta[SERVER_ARGS] = None
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- MLX_VLM_ARGS...]"]


SERVER_ARGS = "apcctl.server_args"


def server_args_given() -> tuple[str, ...] | None:
    """What followed ``--`` on this command line (None: no ``--``)."""
    return click.get_current_context().meta.get(SERVER_ARGS)


@click.command(cls=PassThroughCommand, epilog=EXIT_CODES_SHORT)
@click.option("--server", "--name", "-s", "name", envvar="APCCTL_SERVER", metavar="NAME|URL",
              shell_complete=server_names,
              help="Server name (its state files live in <state dir>/servers/NAME), or the URL of a configured "
                   "or managed server; default: the config's default, its only server, else 'default'. "
                   "[env: APCCTL_SERVER]")
@click.option("--model", "-m", metavar="DIR|REPO", help="Model to serve (default: the config's model).")
@click.option("--port", "-p", type=click.IntRange(1, 65535), help=f"Port (default: the config's, else {DEFAULT_PORT}).")
@click.option("--host", help=f"Interface to bind (default {DEFAULT_HOST}).")
@click.option("--disk-path", type=click.Path(file_okay=False, path_type=Path),
              help="Lineage disk tier directory (default: <server state dir>/lineage-disk).")
@click.option("--shared-disk-path", metavar="DIR",
              help="Join a shared disk tier (APC_SHARED_DISK_PATH; config key shared_disk_path): restore "
                   "the entries other servers of the same model wrote under DIR, and write to DIR/NAME "
                   "(unless --disk-path). DIR must be yours, writable by you only; created 0700 if missing. "
                   "'' turns it off.")
@click.option("--env", "-e", "env_pairs", multiple=True, metavar="KEY=VALUE",
              help="Extra environment for the server, e.g. -e APC_LINEAGE_RAM_BUDGET_BYTES=8000000000.")
@click.option("--api-key", "api_keys", multiple=True, metavar="KEY",
              help="An inference API key (repeatable): every route but /health and /admin then needs "
                   "'Authorization: Bearer KEY', each key its own cache namespace (APC_API_KEYS; kept in the "
                   "0600 server.json, prefer --api-key-file).")
@click.option("--api-key-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="A file of inference API keys, one per line (APC_API_KEY_FILE).")
@click.option("--served-model-name", "served_names", multiple=True, metavar="NAME",
              help="A name clients may send as \"model\" for the served model (repeatable; vLLM's flag; "
                   "APC_SERVED_MODEL_NAME). Any other name but the model's path gets 404.")
@click.option("--allowed-origins", "allowed_origins", multiple=True, metavar="ORIGIN",
              help="A web origin (http://host:port) allowed to call the inference routes, with CORS "
                   "(repeatable; '*': every origin, as stock mlx-vlm; APC_ALLOWED_ORIGINS). Default: none.")
@click.option("--foreground", is_flag=True,
              help="Run in this process (for launchd/systemd): same PID, output to the terminal.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until /health answers.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for /health.")
@click.option("--config", "config_path", envvar="APCCTL_CONFIG", type=click.Path(dir_okay=False, path_type=Path),
              help="TOML config file. [env: APCCTL_CONFIG]")
@json_option
def serve(name: str | None, model: str | None, port: int | None, host: str | None, disk_path: Path | None,
          shared_disk_path: str | None, env_pairs: tuple[str, ...], api_keys: tuple[str, ...], api_key_file: Path | None,
          served_names: tuple[str, ...], allowed_origins: tuple[str, ...], foreground: bool,
          wait: bool, timeout: float, config_path: Path | None, as_json: bool) -> None:
    """Start the patched server in the background: PID file, log file and state under the state dir.

    Only the arguments after -- go to mlx-vlm's server, unchanged (an unknown option before it
    is an error). The server runs with APC_ENABLED=1, its own APC_STATE_DIR (admin token,
    journal) and its own disk tier.

    A stopped server started before (its name has a server.json) starts again with its recorded
    command, as 'docker start' does: the config table's budgets read again, then the flags given
    now (--model, --port, --host, --disk-path, -e, and what follows --) override it; the output
    lists what changed. --foreground (a supervisor's start) always builds the command afresh.

    \b
    Examples:
      apcctl serve --model ~/models/glm5-next --port 8080
      apcctl serve --server b --model DIR --port 8081 -- --max-kv-size 65536
      apcctl serve --server b            # again, after apcctl stop: the recorded command
    """
    env_pairs = (*env_pairs, *api_key_env(api_keys, api_key_file), *serving_env(served_names, allowed_origins),
                 *shared_disk_env(shared_disk_path))
    server_args = server_args_given()
    recorded = None if foreground else recorded_start(name, model, port, host, disk_path, env_pairs, config_path,
                                                       server_args)
    if recorded is not None:
        spec, server, changes = recorded
    else:
        spec, server = server_spec(name, model, port, host, disk_path, env_pairs, config_path, server_args or ())
        changes = None
    if (problem := weights_problem(spec.model)) is not None:
        raise click.UsageError(problem)
    if server.pid() is not None:
        raise CommandError(f"server {spec.name!r} is already running (pid {server.pid()}); "
                           f"apcctl stop --server {spec.name}")
    record = read_record(spec.name)
    if record is not None and not foreground:
        raise CommandError(f"server {spec.name!r} is installed as a {record.supervisor} service ({record.service}): "
                           f"start it with apcctl restart --server {spec.name}, or apcctl service uninstall first")
    if port_busy(spec.host, spec.port):
        raise CommandError(f"port {spec.port} on {spec.host} is already in use")
    sizing = spec_sizing(spec)  # a bad budget stops here; in the foreground the server prints the budgets
    if foreground:
        server.exec_foreground(spec)
    previous = server.spec()
    pid = server.start(spec)
    if wait:
        try:
            server.wait_ready(timeout)
        except ManageError as exc:
            server.discard_start(previous)  # never came up: no record of it for later commands to talk to
            raise CommandError(f"{exc}\n(full log: {server.log_path})") from None
    info = {"server": spec.name, "pid": pid, "url": spec.url, "log": str(server.log_path),
            "state_dir": str(server.directory), "ready": wait, "sizing": sizing,
            "recorded": changes is not None, "changes": changes or []}
    if as_json:
        render.emit_json(info)
        for warning in sizing.warnings:
            click.echo(f"warning: {warning}", err=True)
    else:
        if changes is not None:
            click.echo(f"{spec.name}: the recorded command ({server.spec_path})"
                       + (", changed: " if changes else ", unchanged"), err=True)
            for line in changes:
                click.echo(f"  {line}", err=True)
        click.echo(f"{spec.name}: pid {pid} serving {spec.model} at {spec.url}" + ("" if wait else " (starting)"))
        click.echo(f"log {server.log_path}")
        for line in sizing_lines(sizing):
            click.echo(line, err=line.startswith("warning"))


def server_spec(name: str | None, model: str | None, port: int | None, host: str | None, disk_path: Path | None,
                env_pairs: tuple[str, ...], config_path: Path | None,
                server_args: tuple[str, ...]) -> tuple[ServerSpec, ManagedServer]:
    """The command line and environment ``serve`` (and ``service install``) run: flags, then the
    environment, then the config table (its budgets included)."""
    try:
        config = load_config(config_path)
        name = server_name(name, config)
        settings = config.servers.get(name)
        server = ManagedServer(name)
    except (ConfigError, ManageError) as exc:
        raise click.UsageError(str(exc)) from None
    model = model or (settings.model if settings else None)
    if not model:
        raise click.UsageError("--model is required (or set model= in the server's config table)")
    problem = model_problem(model)
    if problem is not None:
        raise click.UsageError(problem)
    port = port or (settings.port if settings else None) or DEFAULT_PORT
    host = host or (settings.host if settings else None) or DEFAULT_HOST
    extra = (*(settings.args if settings else ()), *server_args)
    budgets = {k: v for k, v in (settings.budget_environment() if settings else {}).items() if k not in os.environ}
    pairs = _env(env_pairs)
    spec = build_spec(name, model=model, port=port, host=host, extra_args=extra, env={**budgets, **pairs},
                      disk_path=disk_path, config_env={k: v for k, v in budgets.items() if k not in pairs})
    return with_shared_disk(spec), server


def with_shared_disk(spec: ServerSpec, previous: ServerSpec | None = None) -> ServerSpec:
    """``spec`` with its shared disk tier (``--shared-disk-path``, else ``APC_SHARED_DISK_PATH``, else
    the config's ``shared_disk_path``) checked and made absolute, and its default disk path moved
    into it (``DIR/NAME``) so that its peers read what it writes; a bad directory is a usage error."""
    from dataclasses import replace

    from apcctl.fleet.shared_disk import SHARED_ENV, SharedDiskError, checked, joined

    value = spec.env.get(SHARED_ENV)
    if value:
        try:
            spec = replace(spec, env={**spec.env, SHARED_ENV: str(checked(value))})
        except SharedDiskError as exc:
            raise click.UsageError(str(exc)) from None
    return joined(spec, previous.env.get(SHARED_ENV) if previous else None)


def recorded_start(name: str | None, model: str | None, port: int | None, host: str | None,
                   disk_path: Path | None, env_pairs: tuple[str, ...], config_path: Path | None,
                   server_args: tuple[str, ...] | None) -> tuple[ServerSpec, ManagedServer, list[str]] | None:
    """A known, stopped server's recorded command with what is given now on top (the config
    table read again as ``restart`` reads it, then the flags), and the lines saying what changed;
    None when the name has no record (a first start) or its server runs."""
    try:
        config = load_config(config_path)
        server = ManagedServer(server_name(name, config))
    except (ConfigError, ManageError) as exc:
        raise click.UsageError(str(exc)) from None
    old = server.spec()
    if old is None or server.pid() is not None:
        return None
    table = config.servers.get(server.name)
    asked = _env(env_pairs)
    # This shell's variables apply where the record has none (as at a first start); a recorded
    # value wins over the shell's (-e changes it), and the plan says so.
    shell = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) and k not in SERVER_OWN_ENV}
    changes = Changes(config_env=table.budget_environment() if table else {},
                      env={**{k: v for k, v in shell.items() if k not in old.env}, **asked}, model=model)
    new = with_shared_disk(rebased(respec(old, changes), port=port, host=host, disk_path=disk_path,
                                   extra_args=server_args), old)
    if (problem := model_problem(new.model)) is not None:
        raise click.UsageError(problem)
    notes = [f"note: {note}".replace("restart -e", "serve -e") for note in override_notes(new, changes, config.path)]
    notes += [f"note: {k}={shown(k, v)} in this shell is not used: the recorded command has {k}="
              f"{shown(k, new.env[k])} (serve -e {k}=... to change it)"
              for k, v in sorted(shell.items()) if k in new.env and new.env[k] != v and k not in asked]
    return new, server, difference(old, new) + notes


def shared_disk_env(path: str | None) -> list[str]:
    """``--shared-disk-path`` as a ``KEY=VALUE`` pair (none without the flag; a blank one turns sharing off)."""
    from apcctl.fleet.shared_disk import SHARED_ENV

    return [] if path is None else [f"{SHARED_ENV}={path}"]


def spec_sizing(spec: ServerSpec) -> Sizing:
    """The budgets this server will run with, the machine's memory and disk, and the warnings;
    a bad value of any ``APC_*`` setting is a usage error here (as ``apcctl config show`` says
    it), rather than a server that exits at start or runs with a feature silently off."""
    from server_patch import settings as registry
    from server_patch.admin.views import sizing_view
    from server_patch.lineage import LineageConfig

    env = {**os.environ, **spec.env}
    if problems := registry.problems(env):
        raise click.UsageError("; ".join(problems) + " (apcctl config show lists every setting)")
    try:
        config = LineageConfig.from_env(env)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return sizing_view(config, env, startup=True)


def sizing_lines(sizing: Sizing) -> list[str]:
    """The budgets line and one ``warning:`` line per thing the machine cannot hold."""
    b, disk = sizing.budgets, sizing.disk
    lines = [f"budgets: RAM {render.human_bytes(b.ram_limit)} (of {render.human_bytes(sizing.ram_total_bytes)} "
             f"physical), anchors {b.anchor_count_limit} / {render.human_bytes(b.anchor_bytes_limit)}, disk "
             + (f"{render.human_bytes(b.disk_limit)} at {disk.path} "
                f"({render.human_bytes(disk.free_bytes)} free)" if disk.enabled else "off")]
    return lines + [f"warning: {w}" for w in sizing.warnings]


def api_key_env(keys: tuple[str, ...], key_file: Path | None) -> list[str]:
    """``--api-key``/``--api-key-file`` as ``KEY=VALUE`` pairs: the keys travel in the environment,
    never on the server's command line (which any local user can read)."""
    if any("," in key or not key.strip() for key in keys):
        raise click.BadParameter("a key cannot be blank or hold a comma (use --api-key-file)", param_hint="--api-key")
    pairs = [f"APC_API_KEYS={','.join(keys)}"] if keys else []
    return pairs + ([f"APC_API_KEY_FILE={key_file.expanduser().resolve()}"] if key_file else [])


def serving_env(served_names: tuple[str, ...], allowed_origins: tuple[str, ...]) -> list[str]:
    """``--served-model-name``/``--allowed-origins`` as ``KEY=VALUE`` pairs (comma-separated values)."""
    pairs = []
    for flag, variable, values in (("--served-model-name", "APC_SERVED_MODEL_NAME", served_names),
                                   ("--allowed-origins", "APC_ALLOWED_ORIGINS", allowed_origins)):
        if any("," in v or not v.strip() for v in values):
            raise click.BadParameter("a value cannot be blank or hold a comma (repeat the flag)", param_hint=flag)
        if values:
            pairs.append(f"{variable}={','.join(v.strip() for v in values)}")
    return pairs


def _env(pairs: tuple[str, ...]) -> dict[str, str]:
    """``-e KEY=VALUE`` pairs; an ``APC_*`` name no setting reads is an error with the name it
    was probably meant to be (a typo would otherwise be ignored by the server)."""
    from server_patch import settings as registry

    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--env")
        env[key] = value
    if unknown := registry.unknown(env):
        raise click.BadParameter("; ".join(unknown), param_hint="--env")
    return env


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


def follow_file(path: Path, write: Callable[[bytes], None], *, poll_s: float = 0.25,
                stop: Callable[[], bool] = lambda: False) -> None:
    """Call ``write`` with every byte appended to ``path``, from its current end, until ``stop()``.

    The server renames ``server.log`` to ``server.log.1`` when it rotates and opens a new one:
    the open file is read to its end first (the lines written just before the rename), then the
    new file from its start. A file truncated in place is read again from its start.
    """
    handle = _open_at_end(path)
    try:
        while not stop():
            chunk = handle.read() if handle else b""
            if chunk:
                write(chunk)
            try:
                current = path.stat()
            except FileNotFoundError:
                current = None
            if handle is None:
                if current is not None:
                    handle = _open(path)  # the file appeared: all of it is new
                else:
                    time.sleep(poll_s)
                continue
            if current is not None and _replaced(handle, current):
                rest = handle.read()  # written between the read above and the rename
                if rest:
                    write(rest)
                for newer in _rotated_after(path, os.fstat(handle.fileno())):
                    write(newer)  # files that came and were rotated away between two polls
                handle.close()
                handle = _open(path)
                continue
            if not chunk:
                time.sleep(poll_s)
    finally:
        if handle is not None:
            handle.close()


def _open(path: Path) -> BinaryIO | None:
    try:
        return path.open("rb")
    except FileNotFoundError:
        return None


def _rotated_after(path: Path, mine: os.stat_result, most: int = 64) -> list[bytes]:
    """The contents of ``path.k-1`` ... ``path.1`` when the file we read is now ``path.k``."""
    names = [path.with_name(f"{path.name}.{n}") for n in range(1, most + 1)]
    for k, name in enumerate(names):
        try:
            found = name.stat()
        except FileNotFoundError:
            break
        if (found.st_ino, found.st_dev) == (mine.st_ino, mine.st_dev):
            out = []
            for newer in reversed(names[:k]):
                try:
                    out.append(newer.read_bytes())
                except FileNotFoundError:
                    pass
            return out
    return []


def _open_at_end(path: Path) -> BinaryIO | None:
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        return None
    handle.seek(0, os.SEEK_END)
    return handle


def _replaced(handle: BinaryIO, current: os.stat_result) -> bool:
    """``path`` is now another file than ``handle`` (rotated), or was truncated below our position."""
    mine = os.fstat(handle.fileno())
    if (mine.st_ino, mine.st_dev) != (current.st_ino, current.st_dev):
        return True
    if current.st_size < handle.tell():
        handle.seek(0)  # truncated in place: read it again from the start
    return False
