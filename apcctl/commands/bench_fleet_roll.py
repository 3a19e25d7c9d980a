"""``apcctl bench fleet-roll``: prefill tokens a fleet restart and a removed server cost (issue 38)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import click

from apcctl.commands.common import CommandError, ExitStatus, json_option
from apcctl.core import render


@click.command("fleet-roll")
@click.option("--model", "-m", metavar="DIR", help="Model for every server (default: the tiny model, built here).")
@click.option("--servers", type=click.IntRange(2, 8), default=3, show_default=True)
@click.option("--requests", type=click.IntRange(8, 2000), default=240, show_default=True,
              help="Requests of the agent trace per run (the roll of 3 servers takes about a minute on a "
                   "loaded 2-core machine: runs much shorter make the clients wait for it).")
@click.option("--agents", type=click.IntRange(1, 16), default=3, show_default=True,
              help="Clients sending at once, each with its own prompts.")
@click.option("--max-tokens", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--tier", "tiers", multiple=True, type=click.Choice(["shared", "private"]),
              help="Disk tiers to measure, each on its own fleet (default: both, side by side): shared (the "
                   "fleet's shared disk tier) or private (--shared-disk-path '': what sharing is measured against).")
@click.option("--policy", default="cache_aware", show_default=True, metavar="POLICY",
              help="smg routing policy of the fleets (fleet up --policy).")
@json_option
def bench_fleet_roll(model: str | None, servers: int, requests: int, agents: int, max_tokens: int,
                     tiers: tuple[str, ...], policy: str, as_json: bool) -> None:
    """The agent trace through a real fleet's gateway: undisturbed, with 'apcctl fleet restart'
    from a quarter of the requests, and with 'apcctl fleet down --server' half-way; the clients
    wait before the last quarter until the disruption ended, so traffic surrounds it. Per run:
    prefill tokens against the undisturbed run (all requests, and those answered after the
    disruption), client errors, answers that differ from a cold server's. Exits 1 when a check
    fails (a client error, an answer unlike a cold server's, a failed disruption). docs/fleet.md.

    \b
    Example:
      apcctl bench fleet-roll --servers 3 --requests 240
    """
    from apcctl.core.gateway import POLICIES
    from apcctl.fleet.roll_bench import TIERS, run_roll_bench
    from apcctl.lab.tinymodel.build import build_model

    if policy not in POLICIES:
        raise click.BadParameter(f"one of {', '.join(POLICIES)}", param_hint="--policy")
    root = Path(tempfile.mkdtemp(prefix="apcctl-bench-roll-"))  # the fleets' state and logs: kept only on failure
    model = model or str(build_model(root / "model", "tiny"))
    try:
        rows = run_roll_bench(model, servers=servers, requests=requests, agents=agents, max_tokens=max_tokens,
                              tiers=tiers or TIERS, policy=policy, root=root,
                              on_progress=lambda line: click.echo(f"bench fleet-roll: {line}", err=True))
    except Exception as exc:  # a failed fleet, gateway or request: one message, not a traceback
        raise CommandError(f"bench fleet-roll: {type(exc).__name__}: {exc} (logs kept in {root})") from None
    shutil.rmtree(root, ignore_errors=True)
    failures = _failures(rows)
    if as_json:
        render.emit_json({"servers": servers, "requests": requests, "agents": agents, "max_tokens": max_tokens,
                          "policy": policy, "rows": rows, "failures": failures})
    else:
        render.console().print(render.table(
            ["tier", "run", "requests", "prefilled", "vs undisturbed", "after it", "after: vs undisturbed",
             "disruption s", "run s", "client errors", "differ from cold"],
            [[r["tier"], r["scenario"], r["requests"], r["prefilled_tokens"], _pct(r["vs_undisturbed"]),
              r["after_requests"] or "-", _pct(r["after_vs_undisturbed"]),
              "-".join(str(t) for t in r["disruption_s"]) or "-", r["run_s"], r["client_errors"],
              r["differ_from_cold"]] for r in rows],
            numeric=("requests", "prefilled", "vs undisturbed", "after it", "after: vs undisturbed", "run s",
                     "client errors", "differ from cold")))
        click.echo("checks: " + ("; ".join(failures) if failures else
                                 "0 client errors, every answer equal to a cold server's, every disruption done"))
    if failures:
        raise click.exceptions.Exit(int(ExitStatus.FAILED))


def _failures(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        where = f"{r['tier']} tier, {r['scenario']}"
        if r["client_errors"]:
            out.append(f"{where}: {r['client_errors']} client errors")
        if r["differ_from_cold"]:
            out.append(f"{where}: {r['differ_from_cold']} answers differ from a cold server's")
        out += [f"{where}: {e}" for e in r["disruption_errors"]]
    return out


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def register(main: click.Group, bench: click.Group) -> None:
    bench.add_command(bench_fleet_roll)
