"""``apcctl config show``: every ``APC_*`` setting, its value in force and where it came from.

The values are read from this shell's environment, as a server started from it (``apcctl
serve``) reads them, plus the budget keys of the server's ``[servers.NAME]`` table, which
``apcctl serve`` passes where the environment sets none. With ``--server`` naming a managed
server, they are read from the command its process runs (``server.running.json``): what it
really uses, whatever this shell says. Nothing talks to a server. The registry
is ``server_patch.settings``; ``--markdown`` prints docs/settings.md.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import click

from apcctl.commands.common import CommandError, ExitStatus
from apcctl.commands.complete import server_names
from apcctl.config import ConfigError, load_config, server_name
from apcctl.core import render
from apcctl.core.manage import ENV_PREFIXES, ManagedServer, ManageError, ServerSpec
from server_patch import settings as registry


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(config)


@click.group()
def config() -> None:
    """The server's APC_* settings (docs/settings.md)."""


@config.command("show")
@click.option("--server", "-s", envvar="APCCTL_SERVER", metavar="NAME", shell_complete=server_names,
              help="A managed server: the values its process runs with; else whose config-file budgets count "
                   "(default: the config's default server). [env: APCCTL_SERVER]")
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
    recorded = _managed_command(server, config_path)
    if recorded is not None:  # what that server runs with, not what this shell would start
        spec, running = recorded
        with _environment(spec.env):
            values = [replace(v, source=registry.CONFIG if v.setting.name in spec.config_env else v.source)
                      for v in registry.in_force(env=spec.env)]
        if not as_json:
            click.echo(f"{spec.name}: " + ("the values the running server uses (its recorded command)" if running
                                            else "not running: the values its next start uses"), err=True)
    else:
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


def _managed_command(server: str | None, config_path: Path | None) -> tuple[ServerSpec, bool] | None:
    """With ``--server NAME`` of a managed server: the command its process runs (or, stopped,
    the one its next start runs), and whether it runs."""
    if not server:
        return None
    try:
        name = server_name(server, load_config(config_path))
        managed = ManagedServer(name)
    except (ConfigError, ManageError):
        return None
    spec = managed.running_spec() if managed.pid() is not None else managed.spec()
    return (spec, managed.pid() is not None) if spec is not None else None


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment as the server's, while derived defaults (paths under its
    state dir) are computed by their readers."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if not k.startswith(ENV_PREFIXES)}, **env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _config_budgets(server: str | None, config_path: Path | None) -> dict[str, str]:
    """The budget variables the server's config table gives ``apcctl serve``."""
    try:
        loaded = load_config(config_path)
        table = loaded.servers.get(server_name(server, loaded))
    except ConfigError as exc:
        raise CommandError(str(exc), ExitStatus.USAGE) from None
    return table.budget_environment() if table else {}
