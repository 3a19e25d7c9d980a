"""What every server command shares: exit codes, the server options, and the error boundary.

Not a command module (it is not listed in MODULES): errors from the admin client become one
message and one documented exit code here, so scripts can trust ``$?``.
"""

from __future__ import annotations

import contextvars
import functools
import io
import sys
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Callable, Iterator

import click

from apcctl.commands.codes import EXIT_CODES_HELP as EXIT_CODES_HELP  # re-exported: the commands import them from here
from apcctl.commands.codes import EXIT_CODES_SHORT as EXIT_CODES_SHORT
from apcctl.commands.codes import ExitStatus
from apcctl.commands.complete import server_names
from apcctl.config import ConfigError, Target, select
from apcctl.core.client import AdminClient, AdminError
from apcctl.core.manage import ManagedServer, ManageError


# Set while --watch --json repeats a command: each result is one line.
_JSON_LINES: contextvars.ContextVar[bool] = contextvars.ContextVar("apcctl_json_lines", default=False)


class CommandError(click.ClickException):
    """One message on stderr and one exit code from ``ExitStatus``; a server's text in it (a log
    tail, an error answer) is cleaned of terminal escapes, its lines kept."""

    def __init__(self, message: str, status: ExitStatus = ExitStatus.FAILED) -> None:
        from apcctl.core.sanitize import printable_lines

        super().__init__(printable_lines(message))
        self.exit_code = int(status)


def exit_status_for(error: AdminError) -> ExitStatus:
    """HTTP status of a failed admin call -> exit code."""
    if error.status == 0:
        return ExitStatus.UNREACHABLE
    if error.status in (401, 403):
        return ExitStatus.AUTH
    if error.status == 404:
        return ExitStatus.NOT_FOUND
    return ExitStatus.FAILED


def command_error(error: AdminError, target: Target) -> CommandError:
    hint = ""
    stopped = target.managed is not None and target.managed.pid() is None
    if error.status != 0 and stopped:  # an answer, but not from the managed server: its port is taken
        hint = (f" (server {target.name!r} is not running, yet something else answers at {target.url}: another "
                f"program holds its port; stop that program, or serve {target.name!r} on another --port)")
    elif error.status in (401, 403) and target.token_problem:
        hint = f" ({target.token_problem})"  # it says what to do
    elif error.status in (401, 403):
        hint = " (give --token, APCCTL_TOKEN, or token_file in the config; the server's token is in its state dir)"
    elif error.status == 0 and stopped:
        hint = (f" (server {target.name!r} is not running: apcctl serve --server {target.name}; "
                f"apcctl forget {target.name} if it is gone for good)")
    return CommandError(f"{target.name}: {error.message}{hint}", exit_status_for(error))


@contextmanager
def talking_to(target: Target) -> Iterator[None]:
    """Turn admin-client and process errors inside the block into ``CommandError``."""
    try:
        yield
    except AdminError as exc:
        raise command_error(exc, target) from None
    except ManageError as exc:
        raise CommandError(f"{target.name}: {exc}") from None


class Targets(list[Target]):
    """The selected servers. ``many`` (``--all``): results are a list, even of one server, and a
    failing server is reported among them instead of ending the command. ``config_path`` is the
    ``--config`` (or ``APCCTL_CONFIG``) they were read from, for a command that reads more of it."""

    def __init__(self, targets: list[Target], many: bool = False, config_path: Path | None = None) -> None:
        super().__init__(targets)
        self.many = many
        self.config_path = config_path


def emit_results(targets: Targets, results: list[Any], one: Callable[[Any], Any] = lambda r: r) -> None:
    """JSON of per-server results: the list with ``--all``, else ``one(result)`` of the only server."""
    from apcctl.core import render

    emit = render.emit_json_line if _JSON_LINES.get() else render.emit_json
    emit(results if targets.many else one(results[0]))


def server_options(*, allow_all: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add ``--server``, ``--token``, ``--config`` (and ``--all``); pass ``targets`` instead."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, server: str | None, token: str | None, config_path: Path | None,
                    all_servers: bool = False, **kwargs: Any) -> Any:
            try:
                targets = Targets(select(server, token, config_path, all_servers), many=all_servers,
                                  config_path=config_path)
            except (ConfigError, ManageError) as exc:
                raise click.UsageError(str(exc)) from None
            return fn(*args, targets=targets, **kwargs)

        if allow_all:
            wrapper = click.option("--all", "all_servers", is_flag=True,
                                   help="Every server in the config file and every managed server.")(wrapper)
        for option in reversed(SERVER_OPTIONS):
            wrapper = option(wrapper)
        return wrapper

    return decorate


SERVER_OPTIONS = (
    click.option("--server", "-s", envvar="APCCTL_SERVER", metavar="NAME|URL", shell_complete=server_names,
                 help="A server name (config file or apcctl serve) or a URL. [env: APCCTL_SERVER]"),
    click.option("--token", envvar="APCCTL_TOKEN", metavar="TOKEN",
                 help="Admin token (default: the config's token_file, then the server's token file). "
                      "[env: APCCTL_TOKEN]"),
    click.option("--config", "config_path", envvar="APCCTL_CONFIG", metavar="PATH",
                 type=click.Path(dir_okay=False, path_type=Path),
                 help="TOML config file (default: user config dir/apcctl/config.toml). [env: APCCTL_CONFIG]"),
)

_OUTPUT_JSON = "apcctl_output_json"


def _remember_output(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value == "json":
        ctx.meta[_OUTPUT_JSON] = True


def _json_or_output(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    # click handles the options given on the command line first, so -o json is known here
    return bool(value or ctx.meta.get(_OUTPUT_JSON))


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--json``, and ``-o json`` / ``--output json`` for kubectl's hands: both set ``as_json``."""
    fn = click.option("--json", "as_json", is_flag=True, callback=_json_or_output,
                      help="Print JSON (stable shape, for scripts).")(fn)
    return click.option("--output", "-o", type=click.Choice(["json"]), expose_value=False, callback=_remember_output,
                        metavar="json", help="-o json: the same as --json (kubectl's spelling).")(fn)


def one(targets: list[Target]) -> Target:
    return targets[0]


def managed(target: Target) -> ManagedServer:
    """The managed server behind ``target``, or exit 5 when ``apcctl serve`` never started it."""
    if target.managed is None:
        raise CommandError(f"{target.name}: not a server started by 'apcctl serve' (no state files)",
                           ExitStatus.NOT_FOUND)
    return target.managed


def full_id(client: AdminClient, given: str) -> str:
    """An entry or anchor id, or (as docker takes them) the start of exactly one: the whole id.
    Several matches are a usage error naming them; none is left to the server (exit 5)."""
    try:
        ids = [e.id for e in client.entries()]
    except AdminError as exc:
        if exc.status == 409:  # no cache yet: no id to expand
            return given
        raise
    matches = sorted(i for i in ids if i.startswith(given))
    if given in ids or not matches:
        return given
    if len(matches) > 1:
        raise CommandError(f"{given!r} starts several ids ({', '.join(matches)}): give more of it", ExitStatus.USAGE)
    return matches[0]


def for_each(targets: Targets, action: Callable[[Target], Any], show: Callable[[list[Any]], None]) -> None:
    """Run ``action`` on every target and ``show`` the results; with ``--all`` a failure becomes
    ``{"server", "error", "exit_code"}`` in the results, and the first one's exit code is the
    command's."""
    results: list[Any] = []
    first_error: CommandError | None = None
    for target in targets:
        try:
            with talking_to(target):
                results.append(action(target))
        except CommandError as exc:
            if not targets.many:
                raise
            click.echo(f"Error: {exc.message}", err=True)
            results.append({"server": target.name, "url": target.url, "error": exc.message,
                            "exit_code": exc.exit_code})
            first_error = first_error or exc
    show(results)
    if first_error is not None:
        raise click.exceptions.Exit(first_error.exit_code)


def watch_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--watch [SECONDS]``: draw again every SECONDS (2 when none is given) until Ctrl-C."""
    return click.option("--watch", "-w", "watch", type=click.FloatRange(0.1, 3600), is_flag=False, flag_value=2.0,
                        default=None, metavar="[SECONDS]",
                        help="Refresh every SECONDS (default 2) until Ctrl-C; with --json, one object per line.")(fn)


def watching(interval: float | None, once: Callable[[], None], *, as_json: bool,
             sleep: Callable[[float], None] = time.sleep) -> None:
    """Run ``once``; with ``interval``, again and again, riding out a failing server (its error
    is shown and the watch goes on). On a terminal each screen is drawn in place (``rich.live``);
    elsewhere the screens follow one another."""
    if interval is None:
        once()
        return
    lines = _JSON_LINES.set(as_json)  # a stream of JSON: one compact object per line, as --follow prints

    def footer() -> None:
        click.echo(f"every {interval:g}s, {time.strftime('%H:%M:%S')}; Ctrl-C stops", err=True)

    try:
        if not as_json and sys.stdout.isatty():
            _watch_in_place(interval, once, footer, sleep)
            return
        while True:
            _reporting(once)
            if not as_json:
                footer()
            sys.stdout.flush()
            sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        _JSON_LINES.reset(lines)


def _reporting(once: Callable[[], None]) -> None:
    """``once``, its failure printed as an error line instead of ending the watch."""
    try:
        once()
    except click.exceptions.Exit:
        pass  # --all: the failing servers were reported; keep watching
    except click.ClickException as exc:
        click.echo(f"Error: {exc.message}", err=True)


class _Frame(io.StringIO):
    """What one screen prints, captured as a terminal would get it (colours, the terminal's width)."""

    def isatty(self) -> bool:
        return True


def _watch_in_place(interval: float, once: Callable[[], None], footer: Callable[[], None],
                    sleep: Callable[[float], None]) -> None:
    """Each screen drawn over the last by ``rich.live.Live`` on the alternate screen, as top does
    (no clear-and-redraw flicker); the last one stays on the terminal after Ctrl-C."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    terminal, last = Console(), Text("")
    try:
        with Live(last, console=terminal, screen=True, auto_refresh=False, redirect_stdout=False,
                  redirect_stderr=False) as live:
            while True:
                frame = _Frame()
                with redirect_stdout(frame), redirect_stderr(frame):
                    _reporting(once)
                    footer()
                last = Text.from_ansi(frame.getvalue())
                live.update(last, refresh=True)
                sleep(interval)
    finally:
        terminal.print(last)
