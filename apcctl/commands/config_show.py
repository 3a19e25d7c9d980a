"""``apcctl config show``: every ``APC_*`` setting, its value in force and where it came from.

The values are read from this shell's environment, as a server started from it (``apcctl
serve``) reads them, plus the budget keys of the server's ``[servers.NAME]`` table, which
``apcctl serve`` passes where the environment sets none. Nothing talks to a server. The registry
is ``server_patch.settings``; ``--markdown`` prints docs/settings.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from apcctl.commands.common import CommandError, ExitStatus
from apcctl.config import ConfigError, load_config, server_name
from apcctl.core import render
from server_patch import settings as registry


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(config)


@click.group()
def config() -> None:
    """The server's APC_* settings (docs/settings.md)."""


@config.command("show")
@click.option("--server", "-s", envvar="APCCTL_SERVER", metavar="NAME",
              help="Whose config-file budgets count (default: the config's default server). [env: APCCTL_SERVER]")
@click.option("--config", "config_path", envvar="APCCTL_CONFIG", metavar="PATH",
              type=click.Path(dir_okay=False, path_type=Path),
              help="TOML config file (default: user config dir/apcctl/config.toml). [env: APCCTL_CONFIG]")
@click.option("--changed", is_flag=True, help="Only the settings not at their default.")
@click.option("--markdown", is_flag=True, help="The reference table of every setting (docs/settings.md).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (stable shape, for scripts).")
def show(server: str | None, config_path: Path | None, changed: bool, markdown: bool, as_json: bool) -> None:
    """Every APC_* setting: its value in force, and whether it came from the environment, the
    config file or the default. A value the server would refuse is shown with why; the exit
    status is then 2."""
    if markdown:
        click.echo(registry.markdown(), nl=False)
        return
    values = registry.in_force(config=_config_budgets(server, config_path))
    bad = [v for v in values if v.error]
    if changed:
        values = [v for v in values if v.source != registry.DEFAULT]
    if as_json:
        render.emit_json({"settings": [v.as_dict() for v in values]})
    else:
        render.console().print(render.table(("variable", "value", "source", "default"), _rows(values)))
    if bad:
        raise CommandError("; ".join(v.error for v in bad), ExitStatus.USAGE)


def _rows(values: list[registry.InForce]) -> list[tuple[Any, ...]]:
    rows = []
    for v in sorted(values, key=lambda v: v.setting.name):
        s = v.setting
        shown = f"invalid: {v.error}" if v.error else (s.shown(v.value) if v.value is not None else s.default_shown)
        rows.append((s.name, shown, v.source, s.default_shown))
    return rows


def _config_budgets(server: str | None, config_path: Path | None) -> dict[str, str]:
    """The budget variables the server's config table gives ``apcctl serve``."""
    try:
        loaded = load_config(config_path)
        table = loaded.servers.get(server_name(server, loaded))
    except ConfigError as exc:
        raise CommandError(str(exc), ExitStatus.USAGE) from None
    return table.budget_environment() if table else {}
