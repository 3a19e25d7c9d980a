"""``apcctl flush``, ``drain`` and ``undrain``: the verbs a restart is made of, one at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import click

from apcctl.commands.common import (EXIT_CODES_SHORT, ExitStatus, Targets, emit_results, for_each, json_option,
                                    server_options)
from apcctl.config import Target
from apcctl.core.client import AdminClient

if TYPE_CHECKING:
    from server_patch.admin.schema import FlushReport


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    for command in (flush, drain, undrain):
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
