"""``apcctl entries``: the lineages (conversation entries and anchors) and their checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from apcctl.commands.common import (EXIT_CODES_SHORT, Targets, emit_results, for_each, full_id, json_option,
                                    server_options, watch_option, watching)
from apcctl.commands.complete import entry_ids
from apcctl.config import Target
from apcctl.core import render
from apcctl.core.client import AdminClient, AdminError

if TYPE_CHECKING:
    from server_patch.admin.schema import EntryInfo

COLUMNS = ("ID", "KIND", "PIN", "TIER", "TOKENS", "RAM", "DISK", "HITS", "LAST USED", "CKPTS", "LABEL")
NUMERIC = ("TOKENS", "RAM", "DISK", "HITS", "CKPTS")


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(entries)


def entry_rows(rows: list[EntryInfo], *, checkpoints: bool = False) -> list[tuple[Any, ...]]:
    """Table rows for entries; with ``checkpoints`` each entry is followed by one row per checkpoint."""
    out: list[tuple[Any, ...]] = []
    for e in rows:
        out.append((e.id, str(e.kind), "yes" if e.pinned else "", str(e.tier), f"{e.length:,}",
                    render.human_bytes(e.bytes) if e.bytes else "-",
                    render.human_bytes(e.disk_bytes) if e.disk_bytes else "-", e.hits,
                    render.ago(e.last_used), len(e.checkpoints), render.printable(e.label or "")[:40]))
        if checkpoints:
            for c in e.checkpoints:
                out.append(("", f"  @{c.length:,}", "", str(c.kind), "", render.human_bytes(c.bytes),
                            "", c.hits, render.ago(c.last_hit) if c.last_hit else "-", "", ""))
    return out


def show_entries(targets: Targets, results: list[dict[str, Any]], *, as_json: bool, checkpoints: bool,
                 title: str) -> None:
    """Print ``[{"server", "entries"}]``: JSON (one server: just its list) or one table per server."""
    if as_json:
        emit_results(targets, results, lambda r: r["entries"])
        return
    out = render.console()
    for result in results:
        if "error" in result:
            continue
        rows = result["entries"]
        out.print(render.table(COLUMNS, entry_rows(rows, checkpoints=checkpoints), numeric=NUMERIC,
                               title=f"[bold]{result['server']}[/] {len(rows)} {title}"))


def entry_or_absorber(client: AdminClient, entry_id: str) -> tuple[EntryInfo, str | None]:
    """``entry_id``'s entry; for an entry absorbed into its conversation's longer entry (the
    server's 404 names it), that entry and ``entry_id`` (the id ``requests`` showed)."""
    from server_patch.admin.schema import absorber_in

    try:
        return client.entry(entry_id), None
    except AdminError as exc:
        into = absorber_in(exc.message) if exc.status == 404 else None
        if into is None:
            raise
        try:
            return client.entry(into), entry_id
        except AdminError:
            raise exc from None  # the absorber went too: the server's first answer says where it went


def _one_entry_json(result: dict[str, Any]) -> Any:
    """One entry's JSON; an absorbed one's absorber says which id was asked for (``absorbed_from``)."""
    entry = result["entries"][0]
    if not result.get("absorbed_from"):
        return entry
    return {**entry.to_json(), "absorbed_from": result["absorbed_from"]}


@click.command(epilog=EXIT_CODES_SHORT)
@server_options(allow_all=True)
@click.argument("entry_id", required=False, shell_complete=entry_ids)
@click.option("--tier", type=click.Choice(["ram", "disk", "all"]), default="all", show_default=True)
@click.option("--kind", type=click.Choice(["conversation", "anchor", "all"]), default="all", show_default=True)
@click.option("--checkpoints", "-c", is_flag=True, help="A row per checkpoint under each entry.")
@json_option
@watch_option
def entries(targets: Targets, entry_id: str | None, tier: str, kind: str, checkpoints: bool,
            as_json: bool, watch: float | None) -> None:
    """List lineage entries and anchors (or show ENTRY_ID, or the one id it starts) with their checkpoints.

    Before the first request the list is empty (not an error): the cache starts with it.

    \b
    Examples:
      apcctl entries --kind anchor
      apcctl entries 3f2a9c01d4e5 --json
    """

    def action(target: Target) -> dict[str, Any]:
        client = target.client()
        if not entry_id:
            return {"server": target.name, "url": target.url, "entries": client.entries(tier=tier, kind=kind)}
        asked = full_id(client, entry_id)
        found, absorbed_from = entry_or_absorber(client, asked)
        return {"server": target.name, "url": target.url, "entries": [found], "absorbed_from": absorbed_from}

    def show(results: list[dict[str, Any]]) -> None:
        for result in results:
            if result.get("absorbed_from"):
                click.echo(f"{result['server']}: {result['absorbed_from']} was absorbed into "
                           f"{result['entries'][0].id} (its conversation's longer entry, which holds its "
                           "state now): showing that one", err=True)
        if entry_id and as_json:
            emit_results(targets, results, _one_entry_json)
            return
        show_entries(targets, results, as_json=as_json, checkpoints=checkpoints or bool(entry_id), title="entries")

    watching(watch, lambda: for_each(targets, action, show), as_json=as_json)
