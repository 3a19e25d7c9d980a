"""``apcctl profile layers on|off|status``: the patched server's per-layer timer.

The server checks a flag file once per forward (``APC_PROFILE_FLAG``, default
``<state dir>/profile/layers.flag``, a 0700 directory), so switching it here takes effect on the next forward without a restart. Records
(one JSON line per forward) go to ``APC_PROFILE_LOG`` or ``<flag>.jsonl``; the server and this
command must see the same environment.
"""

from __future__ import annotations

import json

import click


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(profile)


@click.group()
def profile() -> None:
    """Diagnostics switched on in a running server."""


@profile.group()
def layers() -> None:
    """Per-layer-kind time (sparse attention, linear attention, MoE) of every forward."""


@layers.command("on")
def on() -> None:
    """Create the flag file: every following forward is timed and logged."""
    from server_patch.sparse import profiler

    click.echo(f"on: {profiler.enable()} (records: {profiler.log_path()})")


@layers.command("off")
def off() -> None:
    """Remove the flag file: forwards are no longer timed."""
    from server_patch.sparse import profiler

    was = profiler.disable()
    click.echo(f"off: {profiler.flag_path()}" + ("" if was else " (was already off)"))


@layers.command("status")
@click.option("-n", "--last", default=5, show_default=True, help="How many records to show.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(last: int, as_json: bool) -> None:
    """Whether the timer is on, and the latest records."""
    from apcctl.commands.common import CommandError, ExitStatus
    from server_patch.sparse import profiler

    try:
        records = profiler.read_records(last) if last > 0 else []
    except OSError as exc:  # a FIFO or link in the log's place is refused, never waited on
        raise CommandError(f"cannot read the profile log: {exc}", ExitStatus.FAILED) from None
    state = {
        "enabled": profiler.is_enabled(),
        "flag": str(profiler.flag_path()),
        "log": str(profiler.log_path()),
        "records": records,
    }
    if as_json:
        click.echo(json.dumps(state, indent=2))
        return
    click.echo(f"{'on' if state['enabled'] else 'off'}: flag {state['flag']}, records {state['log']}")
    for record in state["records"]:
        parts = ", ".join(f"{kind} {ms:.1f}" for kind, ms in sorted(record["ms"].items()))
        click.echo(
            f"  chunk {record['chunk']:>5} x{record['batch']}: {record['total_ms']:.1f} ms ({parts})"
        )
