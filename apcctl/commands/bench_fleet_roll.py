"""``apcctl bench fleet-roll``: prefill tokens a fleet restart and a removed server cost (issue 38)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import click

from apcctl.commands.common import CommandError, json_option
from apcctl.core import render


@click.command("fleet-roll")
@click.option("--model", "-m", metavar="DIR", help="Model for every server (default: the tiny model, built here).")
@click.option("--servers", type=click.IntRange(2, 8), default=3, show_default=True)
@click.option("--requests", type=click.IntRange(4, 400), default=24, show_default=True,
              help="Requests of the agent trace per run.")
@click.option("--max-tokens", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--private-disks", is_flag=True,
              help="Each server's disk tier private (APC_SHARED_DISK_PATH=): what sharing is measured against.")
@json_option
def bench_fleet_roll(model: str | None, servers: int, requests: int, max_tokens: int, private_disks: bool,
                     as_json: bool) -> None:
    """The agent trace through a real fleet's gateway: undisturbed, with 'apcctl fleet restart'
    half-way, and with one server removed half-way; prefill tokens against the undisturbed run,
    client errors, answers that differ from a cold server's. docs/fleet.md.

    \b
    Example:
      apcctl bench fleet-roll --servers 3 --requests 24
    """
    from apcctl.fleet.roll_bench import run_roll_bench
    from apcctl.tinymodel.build import build_model

    root = Path(tempfile.mkdtemp(prefix="apcctl-bench-roll-"))  # the fleet's state and logs: kept only on failure
    model = model or str(build_model(root / "model", "tiny"))
    try:
        rows = run_roll_bench(model, servers=servers, requests=requests, max_tokens=max_tokens,
                              shared=not private_disks, root=root,
                              on_progress=lambda line: click.echo(f"bench fleet-roll: {line}", err=True))
    except Exception as exc:  # a failed fleet, gateway or request: one message, not a traceback
        raise CommandError(f"bench fleet-roll: {type(exc).__name__}: {exc} (logs kept in {root})") from None
    shutil.rmtree(root, ignore_errors=True)
    if as_json:
        render.emit_json({"servers": servers, "requests": requests, "max_tokens": max_tokens, "rows": rows})
        return
    render.console().print(render.table(
        ["run", "requests", "prefilled", "vs undisturbed", "client errors", "differ from cold"],
        [[r["scenario"], r["requests"], r["prefilled_tokens"], f"{r['vs_undisturbed']:+.1%}", r["client_errors"],
          r["differ_from_cold"]] for r in rows],
        numeric=("requests", "prefilled", "vs undisturbed", "client errors", "differ from cold")))


def register(main: click.Group, bench: click.Group) -> None:
    bench.add_command(bench_fleet_roll)
