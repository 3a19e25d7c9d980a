"""``apcctl top``: the Textual dashboard, for people (scripts use ``status``/``requests --json``)."""

from __future__ import annotations

from pathlib import Path

import click

from apcctl.commands.common import EXIT_CODES_SHORT, Targets, one, server_options


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(top)


@click.command(epilog=EXIT_CODES_SHORT)
@server_options()
@click.option("--read-only", is_flag=True, help="Hide every key that changes the server: pin, unpin, evict, "
                                                "new anchor, restart.")
@click.option("--replay", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Open a recording (python -m tui.recorded URL TOKEN FILE) instead of a server.")
@click.option("--interval", type=click.FloatRange(min=0.1, max=3600), default=1.0, show_default=True,
              metavar="SECONDS", help="Seconds between polls of the server (+ and - change it inside). The "
                                      "event stream (requests, cache events) is pushed and does not wait on it.")
@click.option("--fleet", "fleet_name", is_flag=False, flag_value="", default=None, metavar="[NAME]",
              help="Open the fleet's dashboard (its first server, plus the Fleet tab), as `apcctl fleet top`.")
def top(targets: Targets, read_only: bool, replay: Path | None, interval: float,
        fleet_name: str | None) -> None:
    """Live dashboard of one server: requests, hit ratio and TTFT, budgets,
    lineage entries with their checkpoints, anchors, and the rolling restart.

    It keeps running while the server restarts and reconnects by itself.
    Press ? inside for the keys.

    \b
    Examples:
      apcctl top
      apcctl top --server http://127.0.0.1:8080 --read-only
      apcctl top --interval 5
      apcctl top --fleet
    """
    if replay is not None:
        from tui.app import make_app
        from tui.recorded import RecordedSource

        make_app(RecordedSource.load(replay), read_only=read_only, refresh_s=interval).run()
        return
    if fleet_name is not None:
        from apcctl.commands.fleet import open_fleet_dashboard

        open_fleet_dashboard(fleet_name or None, None, read_only=read_only, interval=interval,
                             config_path=targets.config_path)
        return
    from tui.app import run_dashboard

    target = one(targets)
    run_dashboard(target.client(), read_only=read_only, restart_targets=[target], refresh_s=interval)
