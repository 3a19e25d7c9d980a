"""``apcctl flush``, ``drain`` and ``undrain``: the verbs a restart is made of, one at a time; and
``logs``, what a managed server wrote."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click

from apcctl.commands.common import (EXIT_CODES_SHORT, CommandError, ExitStatus, Targets, emit_results, for_each,
                                    json_option, managed, one, server_options, talking_to)
from apcctl.config import Target
from apcctl.core import render
from apcctl.core.client import AdminClient

if TYPE_CHECKING:
    from server_patch.admin.schema import FlushReport


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    for command in (flush, drain, undrain, logs):
        main.add_command(command)


def _run(targets: Targets, as_json: bool, call: Callable[[AdminClient], Any], describe: Callable[[Any], str]) -> None:
    """Call every target; print the answers (with ``server``) as JSON or one line per server."""

    def action(target: Target) -> tuple[str, Any]:
        return target.name, call(target.client(timeout=30.0))

    def show(results: list[Any]) -> None:
        if as_json:  # a failing server's result (--all) is its error object already
            emit_results(targets, [r if isinstance(r, dict) else {"server": r[0], **r[1].to_json()} for r in results])
            return
        for result in results:
            if not isinstance(result, dict):
                click.echo(f"{result[0]}: {describe(result[1])}")

    for_each(targets, action, show)


@click.command(epilog=EXIT_CODES_SHORT)
@server_options(allow_all=True)
@click.option("--timeout", type=click.FloatRange(0, 3600, min_open=True), default=60.0, show_default=True,
              help="Seconds to wait for the disk writer.")
@json_option
def flush(targets: Targets, timeout: float, as_json: bool) -> None:
    """Write every RAM entry the disk lacks, and wait for the writes.

    Exits 1 when anything RAM holds did not reach the disk (a full disk, a failing one, a
    timeout): the answer's ``written``, ``failed`` and ``reason`` say what."""
    answers: list[FlushReport] = []

    def call(client: AdminClient) -> FlushReport:
        answer = client.flush(timeout=timeout)
        answers.append(answer)
        return answer

    _run(targets, as_json, call, describe_flush)
    incomplete = [a for a in answers if not a.complete]
    if incomplete:
        click.echo(f"Error: {len(incomplete)} of {len(answers)} servers did not write everything to disk", err=True)
        raise click.exceptions.Exit(int(ExitStatus.FAILED))


def describe_flush(r: FlushReport) -> str:
    if not r.disk_enabled:
        return "the disk tier is off; nothing to write"
    if r.complete:
        return f"{r.written} entries written"
    return f"{r.written} entries written, {r.failed} not: {r.reason}"


@click.command(epilog=EXIT_CODES_SHORT)
@server_options(allow_all=True)
@click.option("--retry-after", type=click.IntRange(1, 3600), default=5, show_default=True,
              help="Seconds clients are told to wait (Retry-After on the 503).")
@json_option
def drain(targets: Targets, retry_after: int, as_json: bool) -> None:
    """Refuse new inference requests (503 + Retry-After); requests in flight finish."""
    _run(targets, as_json, lambda c: c.drain(retry_after),
         lambda r: f"draining, {r.in_flight} in flight, clients retry after {r.retry_after_s}s")


@click.command(epilog=EXIT_CODES_SHORT)
@server_options(allow_all=True)
@json_option
def undrain(targets: Targets, as_json: bool) -> None:
    """Admit new inference requests again."""
    _run(targets, as_json, lambda c: c.undrain(), lambda r: f"admitting requests ({r.in_flight} in flight)")


class _Pattern(click.ParamType):
    """A regular expression (Python's syntax), compiled; a bad one is a usage error (exit 2)."""

    name = "regex"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> "re.Pattern[str]":
        if isinstance(value, re.Pattern):
            return value
        try:
            return re.compile(value)
        except re.error as exc:
            self.fail(f"{value!r} is not a regular expression: {exc}", param, ctx)


# What --grep searches of the log's end (``manage.file_tail`` reads this much); --follow sees all.
_GREP_WINDOW_LINES = 1_000_000


@click.command(epilog=EXIT_CODES_SHORT)
@server_options()
@click.option("--lines", "-n", type=click.IntRange(min=0), default=50, show_default=True,
              help="Lines to show (-n is always a count, as in tail; the server is -s).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing what the server writes (Ctrl-C stops).")
@click.option("--grep", "pattern", type=_Pattern(), metavar="REGEX",
              help="Only lines matching REGEX (Python syntax; (?i) ignores case): the last --lines of those "
                   "in the log's last 256 KiB, then, with --follow, every new one.")
@json_option
def logs(targets: list[Target], lines: int, follow: bool, pattern: "re.Pattern[str] | None", as_json: bool) -> None:
    """Show a managed server's log (uvicorn, the overlay and the apc_lineage lines).

    The server rotates server.log while it runs (APC_LOG_MAX_BYTES, 64 MiB; APC_LOG_BACKUPS, 4
    old files); --follow reads on across a rotation. Escape sequences and control characters
    the log holds (a client's text in a traceback) are not printed (--json keeps them, escaped).
    The dashboard's own /admin polls are not in the access log unless the server runs with
    APC_LOG_ADMIN_REQUESTS=1.
    """
    from apcctl.core.manage import file_tail

    target = one(targets)
    with talking_to(target):
        server = managed(target)
    if not server.log_path.exists():
        raise CommandError(f"{target.name}: no log at {server.log_path} (a --foreground server writes to its "
                           "terminal or supervisor)", ExitStatus.NOT_FOUND)
    show = _LogLines(target.name if as_json else None, server.log_path, pattern)
    tail = file_tail(server.log_path, _GREP_WINDOW_LINES if pattern else lines)
    for line in show.kept(tail.splitlines())[-lines:] if lines else []:
        show.emit(line)
    if follow:
        from apcctl.commands.serve import follow_file

        try:
            follow_file(server.log_path, show.chunk)
        except KeyboardInterrupt:
            pass


class _LogLines:
    """How ``logs`` prints lines: cleaned for the terminal (``render.printable_lines``), or one
    JSON object per line with ``json_server``; only those ``pattern`` matches. Followed chunks
    are cut into whole lines first, so a match and a cleaned escape never span two chunks."""

    def __init__(self, json_server: str | None, path: Path, pattern: "re.Pattern[str] | None") -> None:
        self.json_server, self.path, self.pattern, self.partial = json_server, path, pattern, ""

    def kept(self, lines: list[str]) -> list[str]:
        return [line for line in lines if self.pattern is None or self.pattern.search(line)]

    def emit(self, line: str) -> None:
        if self.json_server is not None:  # {"server", "log", "line"} per line, as every --follow stream prints
            render.emit_json_line({"server": self.json_server, "log": str(self.path), "line": line})
        else:
            click.echo(render.printable_lines(line))

    def chunk(self, data: bytes) -> None:
        *done, self.partial = (self.partial + data.decode("utf-8", errors="replace")).split("\n")
        for line in self.kept(done):
            self.emit(line)
