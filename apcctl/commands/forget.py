"""``apcctl forget``: drop the record of a managed server that is gone for good."""

from __future__ import annotations

import shutil

import click

from apcctl.commands.common import EXIT_CODES_SHORT, CommandError, ExitStatus, json_option
from apcctl.core import render
from apcctl.core.manage import ManagedServer, ManageError, managed_names
from apcctl.service.record import read_record


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(forget)


@click.command(epilog=EXIT_CODES_SHORT)
@click.argument("name")
@click.option("--purge", is_flag=True,
              help="Also delete its state dir: log, admin token, journal and (by default) its disk tier.")
@json_option
def forget(name: str, purge: bool, as_json: bool) -> None:
    """Forget the stopped managed server NAME: no command lists it or talks to it any more
    (status --all included). Its state dir (log, token, journal, disk tier) is kept unless
    --purge; apcctl serve --server NAME starts it afresh on the same files.

    \b
    Examples:
      apcctl forget old
      apcctl forget scratch --purge
    """
    try:
        server = ManagedServer(name)
    except ManageError as exc:
        raise click.UsageError(str(exc)) from None
    if name not in managed_names():
        known = ", ".join(managed_names()) or "none"
        raise CommandError(f"no managed server {name!r}; known: {known}", ExitStatus.NOT_FOUND)
    record = read_record(name)
    if record is not None:
        raise CommandError(f"server {name!r} is installed as a {record.supervisor} service ({record.service}): "
                           f"apcctl service uninstall --server {name} first")
    try:
        removed = server.forget()
    except ManageError as exc:
        raise CommandError(str(exc)) from None
    if purge:
        shutil.rmtree(server.directory, ignore_errors=True)
    info = {"server": name, "removed": [str(p) for p in removed], "state_dir": str(server.directory),
            "purged": purge}
    if as_json:
        render.emit_json(info)
    elif purge:
        click.echo(f"{name}: forgotten; {server.directory} deleted")
    else:
        click.echo(f"{name}: forgotten; its state dir {server.directory} is kept (--purge deletes it)")
