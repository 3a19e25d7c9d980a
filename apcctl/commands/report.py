"""``apcctl report``: what a server's journal says about a window of traffic."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from apcctl.commands.common import EXIT_CODES_SHORT, CommandError, ExitStatus, json_option, one, server_options
from apcctl.config import Target
from apcctl.core import render
from apcctl.journal_report import CANCEL_PHASES, PHASES, parse_since, report as build_report
from server_patch.integration.journal import directory_from_env


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(report)


def journal_dir(target: Target) -> Path:
    """The managed server's journal, else ``APC_JOURNAL_DIR``, else ``<state dir>/journal``."""
    if target.managed is not None and target.managed.spec() is not None:
        return target.managed.journal_dir
    return directory_from_env()


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
@click.option("--what-if", "what_if", metavar="NAME=VALUE,...",
              help="Replay the window through the simulator with the server's settings and with these "
                   "(ram_budget=64G,max_checkpoints=6: any APC_LINEAGE_* field), side by side.")
@click.option("--sizes", default="full", show_default=True,
              help="The model's state sizes for --what-if: full, tiny, or a model's config.json.")
@json_option
def report(targets: list[Target], since: str, until_: str | None, journal: Path | None, what_if: str | None,
           sizes: str, as_json: bool) -> None:
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
    if what_if is not None:
        _what_if(directory, start or 0.0, end, what_if, sizes, as_json)
        return
    summary = build_report(directory, start, end)
    summary["canary"] = canary_report(directory, start or 0.0, end)
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
              "prompt tokens reused")
    if s.get("oracle"):
        from server_patch.lineage.misses import describe

        out.print(f"oracle: {describe(s['oracle'])}")
    if s.get("drift"):
        from apcctl.core.drift_view import describe_drift

        out.print(f"client drift: {describe_drift(s['drift'])}")
    cancelled = {phase: req.get(f"cancelled_in_{phase}", 0) for phase in CANCEL_PHASES}
    if any(cancelled.values()):
        out.print(f"cancelled by their client: {_counts({f'in {k}': v for k, v in cancelled.items()})}")
    for block in (_kinds(req), _latency(s["latency_ms"]), _events(s), _canary(s.get("canary")), _tiers(s["tiers"])):
        if block is not None:
            out.print()
            out.print(block)


def _what_if(directory: Path, since: float, until: float, overrides: str, sizes: str, as_json: bool) -> None:
    """``--what-if``: the window's traffic with the current and the proposed settings."""
    from apcctl.journal_report import read_journal
    from apcctl.lab.sim.sizes import load_sizes
    from apcctl.lab.sim.whatif import parse_overrides, what_if

    try:
        proposed = parse_overrides(overrides)
        state = load_sizes(sizes)
    except (ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--what-if" if "=" in str(exc) else "--sizes") from None
    try:
        result = what_if(read_journal(directory, since, until), state, proposed)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--what-if") from None
    if as_json:
        render.emit_json(result)
        return
    out = render.console()
    out.print(f"{result['requests']:,} journaled prompts ({result['prompt_tokens']:,} tokens), replayed in "
              f"{result['block']}-token blocks with {result['sizes']} state sizes; the server restored "
              f"{result['journal_restored_tokens']:,} tokens")
    current, proposed_run = result["runs"]
    rows = [(label, fmt(current), fmt(proposed_run)) for label, fmt in (
        ("prefill tokens", lambda r: f"{r['prefill_tokens']:,}"),
        ("restored tokens", lambda r: f"{r['restored_tokens']:,}"),
        ("restored / oracle", lambda r: "-" if r["oracle_ratio"] is None else f"{r['oracle_ratio']:.3f}"),
        ("lost", lambda r: _counts(r["lost_tokens"])),
        ("RAM peak", lambda r: render.human_bytes(r["ram_peak_bytes"])),
        ("disk", lambda r: render.human_bytes(r["disk_bytes"])),
        ("checkpoint bytes", lambda r: render.human_bytes(r["checkpoint_bytes"])),
    )]
    out.print(render.table(("", "CURRENT", f"PROPOSED ({overrides})"), rows, title="what if"))


def _kinds(req: dict[str, Any]) -> Table:
    rows = [(kind, f"{v['requests']:,}", render.percent(v["requests"], req["count"]), f"{v['reused_tokens']:,}",
             f"{v['prompt_tokens']:,}") for kind, v in req["by_kind"].items()]
    columns = ("KIND", "REQUESTS", "SHARE", "REUSED TOKENS", "PROMPT TOKENS")
    return render.table(columns, rows, numeric=columns[1:], title="by restore kind")


def _latency(latency: dict[str, Any]) -> Table:
    columns = ("PHASE ms", "p50", "p90", "p99", "max")
    rows = [(phase, *(render.ms(latency[phase][q]) for q in columns[1:])) for phase in PHASES]
    return render.table(columns, rows, numeric=columns[1:], title="time to first token")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def _events(s: dict[str, Any]) -> Table:
    ev, disk, anchors = s["evictions"], s["disk"], s["anchors"]
    pinned_now = "-" if anchors["pinned_now"] is None else anchors["pinned_now"]
    return render.key_values([
        ("evictions", f"{ev['count']:,} ({render.human_bytes(ev['bytes'])}): {_counts(ev['by_reason'])}"),
        ("disk", f"{disk['writes']:,} writes ({render.human_bytes(disk['bytes_written'])}), {disk['promotes']:,} "
                 f"promoted to RAM, {disk['rejects']} rejected; deleted: {_counts(ev['disk_deletes'])}"),
        ("anchors", f"{anchors['pinned']} pinned ({_counts(anchors['by_source'])}), {anchors['unpinned']} unpinned, "
                    f"{pinned_now} pinned at the last snapshot"),
    ])


def canary_report(directory: Path, since: float, until: float) -> dict[str, Any]:
    """The canary's checks in the window, from its ``canary`` cache events (detail:
    ``<result> <kind> key=value ...``): counts by result and kind, the largest difference, failures."""
    from apcctl.journal_report import read_journal

    by_result: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    worst: float | None = None
    failures = []
    for record in read_journal(directory, since, until):
        if record.get("type") != "cache" or record.get("event") != "canary":
            continue
        result, kind, *pairs = str(record.get("detail", "")).split(" ") + ["", ""]
        fields = dict(p.split("=", 1) for p in pairs if "=" in p)
        by_result[result] += 1
        by_kind.setdefault(kind, Counter())[result] += 1
        try:
            worst = max(worst or 0.0, float(fields["diff"]))
        except (KeyError, ValueError):
            pass
        if result == "fail":
            failures.append({"time": record["time"], "kind": kind, "entry_id": record.get("entry_id"),
                             "length": record.get("length"), "detail": record.get("detail")})
    return {"checks": sum(by_result.values()), "by_result": dict(by_result),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}, "max_abs_diff": worst,
            "failures": failures[-20:]}


def _canary(c: dict[str, Any] | None) -> Table | None:
    if not c or not c["checks"]:
        return None
    rows = [("checks", f"{c['checks']:,}: {_counts(c['by_result'])}; largest |diff| "
                       f"{'-' if c['max_abs_diff'] is None else format(c['max_abs_diff'], '.3g')}"),
            *((kind, _counts(counts)) for kind, counts in c["by_kind"].items())]
    rows += [(f"FAILED {_iso(f['time'])}", f"{f['kind']}@{f['length']} entry {f['entry_id']}: {f['detail']}")
             for f in c["failures"]]
    return render.key_values(rows, title="canary (restore vs cold prefill)")


def _tiers(tiers: list[dict[str, Any]]) -> Table | None:
    if not tiers:
        return None
    columns = ("TIME", "RAM", "ANCHORS", "DISK", "ENTRIES", "FILES")
    rows = [(_iso(t["time"]), render.human_bytes(t["ram_bytes"]), render.human_bytes(t["anchor_bytes"]),
             render.human_bytes(t["disk_bytes"]), t["entries"], t["disk_files"]) for t in tiers]
    return render.table(columns, rows, numeric=columns[1:], title="bytes per tier (max per interval)")


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))

