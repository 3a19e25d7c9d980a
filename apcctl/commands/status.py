"""``apcctl status``: one screen per server: identity, process, traffic, budgets, hit rate, and,
for a server a fleet's gateway fronts, the gateway's state of it (``apcctl.fleet.status``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import click

from apcctl.commands.common import (EXIT_CODES_SHORT, Targets, emit_results, for_each, json_option, server_options,
                                    watch_option, watching)
from apcctl.commands.verify import canary_line, canary_state
from apcctl.config import Target
from apcctl.core import render
from apcctl.core.hosts import is_local_url
from apcctl.core.process import sample_once

if TYPE_CHECKING:
    from server_patch.admin.schema import Budgets, Idle, Sizing, Status


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(status)


def process_info(target: Target, pid: int | None) -> dict[str, Any] | None:
    """RSS, CPU, threads and uptime, when the server runs on this machine."""
    if not is_local_url(target.url) and target.managed is None:
        return None
    sample = sample_once(pid)
    return asdict(sample) if sample is not None else None


def stopped(target: Target) -> bool:
    """A managed server stopped on purpose (``apcctl stop``, ``fleet down``): it ran (it has a log)
    and its PID file was removed by the stop. A crash leaves the PID file; a server recorded but
    never started has no log: both stay errors."""
    managed = target.managed
    return managed is not None and not managed.pid_path.exists() and managed.log_path.exists()


def collect(target: Target, listing: bool = False) -> dict[str, Any]:
    """``listing`` (``--all``): a server stopped on purpose is a ``stopped`` row, not an error (as
    ``docker ps -a`` shows ``Exited``); asked for by name, it is still "not running" (exit 3)."""
    from apcctl.core.client import AdminError

    try:
        body = target.client().status()
    except AdminError as exc:
        if listing and exc.status == 0 and stopped(target):
            return {"server": target.name, "url": target.url, "managed": True, "state": "stopped"}
        raise
    return {"server": target.name, "url": target.url, "managed": target.managed is not None, "status": body,
            "process": process_info(target, body.server.pid), "hits": body.hits,
            "canary": canary_state(target.client()) if body.started else None}


@click.command(epilog=EXIT_CODES_SHORT)
@server_options(allow_all=True)
@json_option
@watch_option
def status(targets: Targets, as_json: bool, watch: float | None) -> None:
    """Server, process (RSS, CPU, uptime), traffic, cache budgets and hit rate.

    The budgets, physical memory and the disk volume's free space show from the start, before
    the first request creates the cache.
    """

    def show(results: list[dict[str, Any]]) -> None:
        with_gateway(results)
        if as_json:
            emit_results(targets, results)
            return
        out = render.console()
        for result in results:
            title = f"[bold]{result['server']}[/] {result['url']}"
            if result.get("state") == "stopped":
                rows = [("status", f"stopped (apcctl serve --server {result['server']} starts it again)")]
                out.print(render.key_values(rows + ([_gateway_row(result["gateway"])] if result.get("gateway") else []),
                                            title=title))
                out.print()
            elif "error" not in result:
                out.print(render.key_values(_rows(result), title=title))
                out.print()
            elif result.get("gateway"):  # the server does not answer: what its gateway does about it
                out.print(render.key_values([("status", "unreachable"), _gateway_row(result["gateway"])], title=title))
                out.print()

    watching(watch, lambda: for_each(targets, lambda t: collect(t, targets.many), show), as_json=as_json)


def with_gateway(results: list[dict[str, Any]]) -> None:
    """Add ``gateway`` (fleet, gateway url, state: healthy/draining/unhealthy/absent) to each
    result a fleet fronts; None for a server no fleet names."""
    from apcctl.fleet.status import gateway_views

    views = gateway_views(r["url"] for r in results)
    for result in results:
        result["gateway"] = views.get(result["url"].rstrip("/"))


def _gateway_row(view: dict[str, Any]) -> tuple[str, str]:
    line = f"{view['state']} in fleet {view['fleet']} ({view['gateway']})"
    return "gateway", line + (f": {view['error']}" if view.get("error") else "")


def _rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    from server_patch.admin.schema import Pool

    body: Status = result["status"]
    process, hits = result["process"], body.hits
    server, idle, pool = body.server, body.idle, body.pool or Pool()
    rows = [("model", str(server.model)),
            ("version", f"mlx-vlm {server.mlx_vlm_version} + patch {server.patch_version}"),
            ("server", f"pid {server.pid}, up {render.human_duration(server.uptime_s)}"
                       + (", managed by apcctl" if result["managed"] else ""))]
    if process:
        rows.append(("process", f"RSS {render.human_bytes(process['rss_bytes'])}, CPU {process['cpu_percent']:.0f}%, "
                                f"{process['threads']} threads, up {render.human_duration(process['uptime_s'])}"))
    rows.append(("traffic", f"{idle.in_flight} in flight, {idle.queued} queued, "
                            f"draining {'yes' if idle.draining else 'no'}, " + _last(idle)))
    if result.get("gateway"):
        rows.append(_gateway_row(result["gateway"]))
    rows.append(("mlx memory", f"active {render.human_bytes(pool.active_bytes)}, "
                               f"cache {render.human_bytes(pool.cache_bytes)}, "
                               f"peak {render.human_bytes(pool.peak_bytes)}"))
    lineage, sizing = body.lineage, body.sizing
    if lineage is None:
        rows.append(("cache", "not started yet (it starts with the first request); the budgets are the configured ones"))
    disk_on = bool(lineage.disk_path) if lineage else bool(sizing and sizing.disk.enabled)
    if body.budgets:
        rows += _budget_rows(body.budgets, disk_on, lineage.disk_pending_writes if lineage else 0, sizing)
    rows += [("warning", w) for w in (sizing.warnings if sizing else [])]
    rows += [("invalid", f"{w}: the server runs without it (what reads it is off or at its default); "
                         "restart -e with a valid value") for w in body.invalid_settings]
    if lineage is None:
        return rows
    rows += [
        ("hit rate", f"{render.percent(hits.hits, hits.requests)} of {hits.requests} requests, "
                     f"{render.percent(hits.reused_tokens, hits.reused_tokens + hits.prefill_tokens)} "
                     f"of prompt tokens reused"),
        ("by kind", ", ".join(f"{k} {v}" for k, v in sorted(hits.by_kind.items())) or "-"),
        ("canary", canary_line(result.get("canary"))),
    ]
    if body.oracle is not None:
        from server_patch.lineage.misses import describe

        rows.append(("oracle", describe(body.oracle)))
    return rows


def _budget_rows(b: Budgets, disk_on: bool, pending: int, sizing: Sizing | None) -> list[tuple[str, str]]:
    """Used / limit of the RAM, anchor and disk budgets, and what the machine has for them."""
    ram_total = sizing.ram_total_bytes if sizing else None
    rows = [("ram", f"{render.human_bytes(b.ram_used)} / {render.human_bytes(b.ram_limit)} "
                    f"({b.entries} entries)" + (f", {render.human_bytes(ram_total)} physical" if ram_total else "")),
            ("anchors", render.anchors_line(b)),
            ("disk", (f"{render.human_bytes(b.disk_used)} / {render.human_bytes(b.disk_limit)} "
                      f"({b.disk_files} files, {pending} writes pending)") if disk_on else "off")]
    disk = sizing.disk if sizing else None
    if disk_on and disk is not None and disk.free_bytes is not None:
        rows.append(("volume", f"{render.human_bytes(disk.free_bytes)} free of "
                               f"{render.human_bytes(disk.total_bytes)} at {disk.path}"))
    return rows


def _last(idle: Idle) -> str:
    seconds = idle.since_last_finished_s
    return "no request yet" if seconds is None else f"last finished {render.human_duration(seconds)} ago"
