"""``apcctl check``: verify the lineage disk tier's files offline, like ``fsck``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from apcctl.commands.common import CommandError, ExitStatus, json_option, one, server_options
from apcctl.config import Target

if TYPE_CHECKING:
    from server_patch.disk.fsck import CheckReport


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(check)


def disk_path_of(target: Target) -> Path:
    """The documented precedence (docs/cli.md): ``APC_LINEAGE_DISK_PATH`` in this shell, then the
    path the managed server's record says it runs with, then the server's own default. A shared
    directory is read where the server puts its files: its private ``apcctl-<uid>`` subdirectory."""
    from server_patch import settings

    spec = target.managed.spec() if target.managed is not None else None
    configured = settings.value("APC_LINEAGE_DISK_PATH") or (spec.env.get("APC_LINEAGE_DISK_PATH") if spec else None)
    return server_root(Path(configured)) if configured else server_root(None)


def server_root(given: Path | None) -> Path:
    """Where a server given ``given`` (None: its default) keeps its disk files."""
    from server_patch.disk_paths import default_disk_root

    return default_disk_root(None if given is None else {"APC_LINEAGE_DISK_PATH": str(given.expanduser())})


@click.command(epilog="Exit codes: 0 clean, 1 damaged files found (removed with --fix), "
                      "2 usage error, not a lineage disk directory, or --fix refused (a server holds "
                      "the directory).")
@server_options()
@click.option("--disk-path", type=click.Path(file_okay=False, path_type=Path),
              help="Lineage disk directory (default: APC_LINEAGE_DISK_PATH, else the managed server's recorded "
                   "disk path, else the per-user cache dir).")
@click.option("--fix", is_flag=True, help="Remove damaged files (refused while a server holds the directory).")
@json_option
def check(targets: list[Target], disk_path: Path | None, fix: bool, as_json: bool) -> None:
    """Verify every lineage disk file without loading a model.

    Checks what a server checks before restoring, except what needs the model itself: the
    header's structure and sizes, the format version, the header and tensor-data hashes, the
    metadata against the tensor table, the mlx / mlx-vlm / patch versions that wrote the file
    against the installed ones, and the file's model fingerprint against its per-fingerprint
    directory. Files for another model in their own directory are not damaged (the server
    for that model uses them). Run it from the server's installation: versions are compared
    with the ones installed here. A server may be running: its in-flight temp files are
    skipped, and --fix is refused.

    Only files in the per-fingerprint subdirectories of a lineage disk directory (one with the
    server's .apc-lineage-tier marker, or an earlier version's layout) are checked or removed;
    any other file is listed as foreign and never touched, and a directory that is not a
    lineage disk directory (a models directory) exits 2.

    \b
    Examples:
      apcctl check
      apcctl check --disk-path ~/.cache/apcctl/lineage --fix
      apcctl check --server main --json
    """
    from apcctl.core import render
    from server_patch.disk.fsck import DiskInUse, NotATier, check_dir

    root = server_root(disk_path) if disk_path is not None else disk_path_of(one(targets))
    if not root.is_dir():
        raise CommandError(f"no lineage disk directory at {root}", ExitStatus.USAGE)
    try:
        report = check_dir(root, fix=fix)
    except DiskInUse as exc:
        raise CommandError(f"{exc}; stop it before --fix (a check without --fix is safe)",
                           ExitStatus.USAGE) from None
    except NotATier as exc:
        raise CommandError(f"refusing --fix: {exc}", ExitStatus.USAGE) from None
    if as_json:
        render.emit_json(report.as_dict())
    else:
        _show(report)
    if not report.tier and report.foreign:
        raise CommandError(f"{NotATier(root)}; its {len(report.foreign)} files are foreign", ExitStatus.USAGE)
    if not report.clean:
        raise click.exceptions.Exit(int(ExitStatus.FAILED))


def _show(report: CheckReport) -> None:
    damaged = len(report.damaged)
    click.echo(f"{report.disk_path}: {report.checked} files checked, {damaged} damaged"
               + ("" if report.in_use_by is None else f" (in use by process {report.in_use_by or '?'})"))
    for finding in report.damaged:
        action = "removed" if finding.removed else "damaged"
        click.echo(f"  {action}: {finding.path}: {finding.reason}: {finding.detail}")
    for path in report.foreign:
        click.echo(f"  foreign (not the server's, never removed): {path}")
    if damaged and not report.fixed:
        click.echo("run with --fix to remove them (or let the server reject them at start)")
