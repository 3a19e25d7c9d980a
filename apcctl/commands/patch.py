"""``apcctl patch``: review and check the mlx-vlm overlay without starting a server."""

from __future__ import annotations

import json
import sys

import click


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(patch)


@click.group()
def patch() -> None:
    """The exact-text edits the lineage patch applies to mlx-vlm 0.7.10."""


@patch.command("diff")
def diff() -> None:
    """Print the unified diff of every patched file (installed pristine vs patched)."""
    from server_patch.overlay import PatchError, unified_diff

    try:
        text = unified_diff()
    except PatchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(text, nl=False)


@patch.command("verify")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
def verify(as_json: bool) -> None:
    """Check every edit against the installed files: exit 0 if all match exactly once, else 1."""
    from server_patch.overlay import PatchError, installed_path, verify_all
    from server_patch.overlay.patches import load_topics

    registry = load_topics()
    try:
        verify_all(registry)
        problems: tuple[str, ...] = ()
    except PatchError as exc:
        problems = exc.problems
    if as_json:
        files = [
            {
                "module": p.module,
                "relpath": p.relpath,
                "path": _path(installed_path, p),
                "sha256": p.sha256,
                "edits": [edit.name for edit in p.edits],
            }
            for p in sorted(registry.values(), key=lambda p: p.module)
        ]
        click.echo(json.dumps({"ok": not problems, "files": files, "problems": list(problems)}, indent=2))
    elif problems:
        click.echo("patch does not apply:", err=True)
        for problem in problems:
            click.echo(f"  {problem}", err=True)
    else:
        edits = sum(len(p.edits) for p in registry.values())
        click.echo(f"ok: {edits} edits in {len(registry)} files match the installed mlx-vlm")
    sys.exit(1 if problems else 0)


def _path(installed_path, file_patch) -> str | None:
    try:
        return str(installed_path(file_patch))
    except Exception:  # a missing package is already listed in the problems
        return None
