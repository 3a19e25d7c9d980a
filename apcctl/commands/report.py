"""``apcctl report``: what a server's journal says about a window of traffic."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import click

from apcctl import render
from apcctl.commands.common import EXIT_CODES_SHORT, CommandError, ExitStatus, json_option, one, server_options
from apcctl.config import Target
from apcctl.journal_report import PHASES, parse_since, report as build_report
from server_patch.paths import state_dir


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(report)


def journal_dir(target: Target) -> Path:
    """The managed server's journal, else ``APC_JOURNAL_DIR``, else ``<state dir>/journal``."""
    if target.managed is not None and target.managed.spec() is not None:
        return target.managed.journal_dir
    return Path(os.environ.get("APC_JOURNAL_DIR") or state_dir() / "journal")


def _when(text: str | None, param: str, default: float | None) -> float | None:
    if text is None:
        return default
    try:
        return parse_since(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=param) from None


@click.command(epilog=EXIT_CODES_SHORT)
@server_options()
@click.option("--since", default="7d", show_default=True, help="Window start: 30m, 12h, 7d, 2w or an ISO date.")
@click.option("--until", "until_", help="Window end (same forms; default now).")
@click.option("--journal", "journal", type=click.Path(file_okay=False, path_type=Path),
              help="Journal directory (default: the server's state dir/journal).")
@json_option
def report(targets: list[Target], since: str, until_: str | None, journal: Path | None, as_json: bool) -> None:
    """Summarise the journal: hit rate and reused tokens by restore kind, TTFT percentiles split
    into lookup/admission/prefill/commit, evictions, bytes per tier over time, anchors pinned.

    Reads the journal files directly; the server need not run.

    \b
    Examples:
      apcctl report --since 7d
      apcctl report --since 2026-11-01 --until 2026-11-08 --json
    """
    directory = journal or journal_dir(one(targets))
    if not directory.is_dir():
        raise CommandError(f"no journal at {directory}", ExitStatus.NOT_FOUND)
    start = _when(since, "--since", None)
    end = _when(until_, "--until", time.time())
    summary = build_report(directory, start, end)
    if as_json:
        render.emit_json(summary)
    else:
        _show(summary)


def _show(s: dict[str, Any]) -> None:
    out = render.console()
    w, req = s["window"], s["requests"]
    out.print(f"[bold]journal[/] {w['journal']} ({w['files']} files): {_iso(w['since'])} to {_iso(w['until'])}, "
              f"{w['server_starts']} server starts")
    out.print(f"{req['count']:,} requests, hit rate {render.percent(req['hits'], req['count'])}, "
              f"{render.percent(req['reused_tokens'], req['prompt_tokens'])} of {req['prompt_tokens']:,} "
              f"prompt tokens reused\n")
    out.print(render.table(("KIND", "REQUESTS", "SHARE", "REUSED TOKENS", "PROMPT TOKENS"),
                           [(k, f"{v['requests']:,}", render.percent(v["requests"], req["count"]),
                             f"{v['reused_tokens']:,}", f"{v['prompt_tokens']:,}") for k, v in req["by_kind"].items()],
                           numeric=("REQUESTS", "SHARE", "REUSED TOKENS", "PROMPT TOKENS"), title="by restore kind"))
    out.print()
    out.print(render.table(("PHASE ms", "p50", "p90", "p99", "max"),
                           [(p, *(render.ms(s["latency_ms"][p][q]) for q in ("p50", "p90", "p99", "max")))
                            for p in PHASES], numeric=("p50", "p90", "p99", "max"), title="time to first token"))
    ev, disk, anchors = s["evictions"], s["disk"], s["anchors"]
    out.print()
    out.print(render.key_values([
        ("evictions", f"{ev['count']:,} ({render.human_bytes(ev['bytes'])}): "
                      + (", ".join(f"{k} {v}" for k, v in ev["by_reason"].items()) or "-")),
        ("disk", f"{disk['writes']:,} writes ({render.human_bytes(disk['bytes_written'])}), "
                 f"{disk['promotes']:,} promoted to RAM, {disk['rejects']} rejected; deleted: "
                 + (", ".join(f"{k} {v}" for k, v in ev["disk_deletes"].items()) or "-")),
        ("anchors", f"{anchors['pinned']} pinned ("
                    + (", ".join(f"{k} {v}" for k, v in anchors["by_source"].items()) or "-")
                    + f"), {anchors['unpinned']} unpinned, {_or_dash(anchors['pinned_now'])} pinned at the last snapshot"),
    ]))
    if s["tiers"]:
        out.print()
        out.print(render.table(("TIME", "RAM", "ANCHORS", "DISK", "ENTRIES", "FILES"),
                               [(_iso(t["time"]), render.human_bytes(t["ram_bytes"]), render.human_bytes(t["anchor_bytes"]),
                                 render.human_bytes(t["disk_bytes"]), t["entries"], t["disk_files"]) for t in s["tiers"]],
                               numeric=("RAM", "ANCHORS", "DISK", "ENTRIES", "FILES"), title="bytes per tier (max per interval)"))


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)
