"""``apcctl verify``: ask a server to prove its restores equal a cold prefill (the canary)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from apcctl.commands.common import CommandError, ExitStatus, full_id, json_option, one, server_options, talking_to
from apcctl.config import Target
from apcctl.core import render
from apcctl.core.client import AdminClient

if TYPE_CHECKING:
    from server_patch.admin.schema import CanaryState, VerifyReport

COLUMNS = ("KIND", "TIER", "ENTRY", "LENGTH", "CHECKED", "MODE", "MAX DIFF", "TOL", "TOP-K", "GREEDY", "RESULT")
NUMERIC = ("LENGTH", "CHECKED", "MAX DIFF", "TOL", "TOP-K")


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(verify)


def canary_state(client: AdminClient) -> CanaryState | None:
    """``GET /admin/verify`` (counters, last result, suspects), or None from a server without it."""
    from apcctl.core.client import AdminError

    try:
        return client.canary()
    except AdminError as exc:
        if exc.status in (404, 409):
            return None
        raise


def canary_line(state: CanaryState | None) -> str:
    """One line for ``apcctl status``: counts, the last difference, suspect kinds."""
    if not state:
        return "no checks yet"
    counts, last = state.counts, state.last or {}
    text = ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "no checks yet"
    if last:
        text += f"; last {last['kind']}@{last['length']} diff {last['max_abs_diff']:.3g} (tol {last['tolerance']:.3g})"
    if state.suspects:
        text += f"; SUSPECT: {', '.join(sorted(state.suspects))}"
        text += " (served cold)" if state.on_fail == "cold" else ""
    interval = state.interval_s or 0
    return text + (f"; every {render.human_duration(interval)}" if interval else "")


@click.command(epilog="Exit codes: 0 every check passed (or was skipped), 1 a check failed or did not "
                      "finish in time, 2 usage, 3 unreachable, 4 auth failed, 5 unknown entry.")
@server_options()
@click.option("--entry", "entry_id", metavar="ID", help="Every restore point of this entry (RAM and disk file).")
@click.option("--recent", type=click.IntRange(1, 1000), metavar="N",
              help="Every restore point of the N most recently used entries.")
@click.option("--timeout", type=click.FloatRange(1, 3600), default=600, show_default=True,
              help="Seconds to wait for the server to be idle and finish.")
@click.option("--clear", is_flag=True, help="Clear suspect restore kinds instead (requests restore them again).")
@click.option("--kind", metavar="KIND", help="With --clear: only this restore kind.")
@json_option
def verify(targets: list[Target], entry_id: str | None, recent: int | None, timeout: float, clear: bool,
           kind: str | None, as_json: bool) -> None:
    """Check restore points against a cold prefill of the same tokens on the server's model.

    Each point (an entry's head, its checkpoints, an anchor, a disk file) is restored exactly
    as a request would restore it, one probe token is run, and the next-token logits are
    compared with a cold prefill: max |difference| against a tolerance for the model's dtype,
    top-5 agreement, the greedy token. The server runs checks only while idle and yields to
    any request; a check costs a cold prefill of the checked length. Without --entry or
    --recent: one point of every restore kind the cache holds.

    \b
    Examples:
      apcctl verify
      apcctl verify --entry 3f2a9c01d4e5 --json
      apcctl verify --recent 5
      apcctl verify --clear
    """
    if entry_id and recent:
        raise click.UsageError("give --entry or --recent, not both")
    if kind and not clear:
        raise click.UsageError("--kind goes with --clear")
    target = one(targets)
    client = target.client()
    with talking_to(target):
        if clear:
            body = client.clear_suspects(kind)
        else:
            body = client.verify(entry_id=full_id(client, entry_id) if entry_id else None, recent=recent,
                                 timeout=timeout)
    if as_json:
        render.emit_json(body)
    elif clear:
        click.echo(f"cleared: {', '.join(body.cleared) or 'nothing'}; suspect now: "
                   f"{', '.join(body.suspects) or 'none'}")
    else:
        _show(body)
    if not clear:
        _exit_for(body)


def _show(body: VerifyReport) -> None:
    out = render.console()
    rows = [(r["kind"] if r["kind"] == r["stored_kind"] else f"{r['kind']}:{r['stored_kind']}", r["tier"],
             r["entry_id"], f"{r['length']:,}", f"{r['checked_tokens']:,}",
             f"window@{r['base']:,}" if r["mode"] == "window" else r["mode"],
             _num(r.get("max_abs_diff")), _num(r.get("tolerance")),
             "-" if r.get("top_k_agreement") is None else f"{r['top_k_agreement']:.2f}",
             "-" if r.get("greedy_cold") is None else
             ("same" if r["greedy_cold"] == r["greedy_restored"] else f"{r['greedy_restored']}!={r['greedy_cold']}"),
             r["result"] if r["result"] == "pass" else f"{r['result']}: {r['reason']}")
            for r in body.results]
    out.print(render.table(COLUMNS, rows, numeric=NUMERIC, title=f"{body.points} restore points"))
    summary = f"{body.passed} passed, {body.failed} failed, {body.skipped} skipped"
    if body.abandoned:
        summary += f"; yielded to requests {body.abandoned} times"
    if body.suspects:
        summary += f"; suspect restore kinds: {', '.join(body.suspects)}"
    click.echo(summary if body.complete else summary + "; NOT COMPLETE (the server was not idle long enough)")


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _exit_for(body: VerifyReport) -> None:
    if body.failed or body.errors:
        raise click.exceptions.Exit(int(ExitStatus.FAILED))
    if not body.complete:
        raise CommandError("the checks did not finish in time (the server was busy); run again later")
