"""``apcctl requests``: per-request timings (restore kind, reused tokens, what an unbounded cache
would have restored and why the rest was lost, lookup to first token, and the time it waited for
other requests' work)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import click

from apcctl.commands.common import (
    EXIT_CODES_SHORT, CommandError, ExitStatus, json_option, one, server_options, talking_to,
)
from apcctl.config import Target
from apcctl.core import render
from apcctl.core.client import AdminClient, AdminError
from apcctl.core.drift_view import detail_lines, drift_label
from apcctl.core.follow_lines import FollowLines

if TYPE_CHECKING:
    from server_patch.admin.schema import RequestRecord

COLUMNS = ("SEQ", "TIME", "KIND", "PROMPT", "REUSED", "ORACLE", "LOST", "DRIFT", "LOOKUP", "ADMIT", "PREFILL",
           "COMMIT", "TTFT ms", "WAIT ms", "GAP ms", "ENTRY")
# --follow: the widths values commonly take (a clock; "entry/staged"; milliseconds like 1,234.5).
FOLLOW_WIDTHS = {"TIME": 8, "KIND": 12, "LOOKUP": 7, "ADMIT": 7, "PREFILL": 7, "COMMIT": 7, "TTFT ms": 7}
NUMERIC = ("SEQ", "PROMPT", "REUSED", "ORACLE", "LOOKUP", "ADMIT", "PREFILL", "COMMIT", "TTFT ms")
LINE = "{:>6} {:8} {:12} {:>7} {:>7} {:>7} {:14} {:16} {:>8} {:>8} {:>9} {:>8} {:>9} {:16} {:16} {}"


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(requests)


def row(record: RequestRecord | Mapping[str, Any]) -> tuple[object, ...]:
    from server_patch.admin.schema import RequestRecord

    r = RequestRecord.of(record)
    return (r.seq, render.clock(r.started), render.restore_label(r), f"{r.prompt_tokens:,}",
            f"{r.restored_tokens:,}", f"{r.oracle:,}", render.lost_label(r), drift_label(r),
            render.ms(r.lookup_ms), render.ms(r.admission_ms),
            render.ms(r.prefill_ms), render.ms(r.commit_ms), render.ms(r.ttft_ms), render.wait_label(r),
            render.gap_label(r), r.entry_id or "-")


def format_request(r: RequestRecord | Mapping[str, Any]) -> str:
    """One aligned line per request, for ``--follow`` and the demo's live view."""
    return LINE.format(*row(r))


def header() -> str:
    return LINE.format(*COLUMNS)


def poll(client: AdminClient, since: int = 0, interval: float = 1.0) -> Iterator[RequestRecord]:
    """New request records forever; rides out restarts (sequence numbers start again at 1)."""
    last, waiting = since, False
    while True:
        try:
            batch = client.requests(since=last, limit=5000)
            if not batch and last and max((r.seq for r in client.requests(since=0, limit=1)), default=0) < last:
                last = 0  # the server restarted: its ring starts over
                continue
            waiting = False
        except AdminError as exc:
            if exc.status not in (0, 409, 503):
                raise
            if not waiting:
                click.echo(f"(waiting for the server: {exc.message})", err=True)
            waiting, batch = True, []
        for record in batch:
            last = max(last, record.seq)
            yield record
        time.sleep(interval)


def stream(client: AdminClient, since: int = 0) -> Iterator[RequestRecord]:
    """Request records from the server-sent event stream."""
    from server_patch.admin.schema import RequestRecord

    for name, data in client.events(since=0, timeout=60):
        if name == "request" and (record := RequestRecord.from_json(data)).seq > since:
            yield record


def _take(records: Iterator[RequestRecord], count: int | None, emit: Callable[[RequestRecord], None]) -> None:
    seen = 0
    try:
        for record in records:
            emit(record)
            seen += 1
            if count and seen >= count:
                return
    except KeyboardInterrupt:
        pass


@click.command(epilog=EXIT_CODES_SHORT)
@click.argument("ident", metavar="[ID]", required=False)
@server_options()
@click.option("--since", type=click.IntRange(min=0), default=0, show_default=True,
              help="Only records with a larger sequence number.")
@click.option("--limit", "-n", type=click.IntRange(1, 5000), default=50, show_default=True,
              help="Newest records to show (-n is a count, as in tail).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new records (polls /admin/requests?since=).")
@click.option("--sse", is_flag=True, help="With --follow: read the /admin/events stream instead of polling.")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between polls.")
@click.option("--count", type=click.IntRange(min=1), help="With --follow: stop after this many records.")
@json_option
def requests(ident: str | None, targets: list[Target], since: int, limit: int, follow: bool, sse: bool,
             interval: float, count: int | None, as_json: bool) -> None:
    """Request timings: restore kind, reused tokens, lookup/admission/prefill/commit and TTFT (ms),
    and WAIT: the time it waited for other requests' work, and what most of it was.

    WAIT accrues until the request's row ends ("ended": true in --json); --follow prints each record
    at its first token, so its WAIT is what it had waited by then.

    GAP: its longest gap between two tokens while it decoded, and what most of it was (another's
    join, prefill, ... or its own step); ID shows every part of it (worst_gap, gaps: the parts add
    up to the gap).

    With --json and --follow, one JSON object per line.

    DRIFT: what the client changed against the nearest earlier prompt of its namespace (cause and
    token); ID (a SEQ or a request id) shows one record whole, with a short text diff there.

    \b
    Examples:
      apcctl requests -n 20
      apcctl requests 42
      apcctl requests --follow --json | jq .ttft_ms
    """
    target = one(targets)
    client = target.client()
    if ident is not None:
        with talking_to(target):
            found = [r for r in client.requests(since=0, limit=5000) if ident in (str(r.seq), r.request_id)]
        if not found:
            raise CommandError(f"no request {ident!r} in the server's recent records", ExitStatus.NOT_FOUND)
        record = found[-1].to_json()
        if as_json:
            render.emit_json(record)
        else:
            click.echo("\n".join(detail_lines(record)))
        return
    if not follow:
        with talking_to(target):
            records = client.requests(since=since, limit=limit)
        if as_json:
            render.emit_json(records)
        else:
            render.console().print(render.table(COLUMNS, [row(r) for r in records], numeric=NUMERIC))
        return
    lines = FollowLines(COLUMNS, NUMERIC, FOLLOW_WIDTHS)  # as wide as what arrives: what a table fits, unwrapped
    with talking_to(target):
        source = stream(client, since) if sse else poll(client, since, interval)
        _take(source, count, render.emit_json_line if as_json else lambda r: click.echo("\n".join(lines.lines(row(r)))))
