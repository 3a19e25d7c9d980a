"""Shell completion of server names and entry ids, and "did you mean" for a mistyped command.

Completion runs inside the user's shell at every TAB (click's ``shell_complete`` callbacks): it
must be quick and never print an error there, so every failure (no config, a server that does
not answer, a wrong token) completes nothing. Entry ids come from the server over HTTP, as every
command reads them, with a short timeout. Not a command module (it is not in ``MODULES``).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem

ENTRY_TIMEOUT_S = 2.0  # a TAB that waits longer than this is worse than no completion


def server_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """``--server <TAB>``: the config file's servers and the managed ones."""
    try:
        from apcctl.config import load_config
        from apcctl.core.manage import managed_names

        config = load_config(_config_path(ctx))
        names = dict.fromkeys([*config.servers, *managed_names()])
    except Exception:  # noqa: BLE001 (a TAB never prints a traceback into the shell)
        return []
    return [CompletionItem(name) for name in names if name.startswith(incomplete)]


def entry_ids(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """``entries d3<TAB>``: the ids of the selected server's entries that start so, each with its
    kind and label as help (zsh and fish show it)."""
    try:
        from apcctl.config import select

        params = ctx.params
        target = select(params.get("server"), params.get("token"), _config_path(ctx))[0]
        entries = target.client(timeout=ENTRY_TIMEOUT_S).entries()
    except Exception:  # noqa: BLE001 (unreachable, no token, no config: complete nothing)
        return []
    from apcctl.core.sanitize import printable

    return [CompletionItem(e.id, help=printable(f"{e.kind} {e.label or ''}").strip()[:60])
            for e in entries if e.id.startswith(incomplete)]


def _config_path(ctx: click.Context) -> Path | None:
    value: Any = ctx.params.get("config_path")
    return Path(value) if value else None


class SuggestingGroup(click.Group):
    """A group whose unknown command is a usage error with the closest names, as click already
    does for a mistyped option (``No such option: --modle. Did you mean --model?``)."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[Any, ...]:
        name = click.utils.make_str(args[0]) if args else ""
        if name and not name.startswith("-") and not ctx.resilient_parsing and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=3, cutoff=0.6)
            if close:
                ctx.fail(f"No such command {name!r}. Did you mean {' or '.join(repr(c) for c in close)}?")
        return super().resolve_command(ctx, args)
