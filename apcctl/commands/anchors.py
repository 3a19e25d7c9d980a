"""``apcctl anchors``: list, pin, unpin, evict, and prefill new system-prompt anchors."""

from __future__ import annotations

import json
from typing import Any, Callable

import click

from apcctl.commands.common import (EXIT_CODES_SHORT, Targets, for_each, full_id, json_option, one, server_options,
                                    talking_to)
from apcctl.commands.complete import entry_ids
from apcctl.commands.entries import show_entries
from apcctl.config import Target
from apcctl.core import render
from apcctl.core.client import AdminClient


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(anchors)


@click.group(epilog=EXIT_CODES_SHORT)
def anchors() -> None:
    """Anchors: pinned system prompt (+ tools) prefixes that every session shares."""


@anchors.command("list", epilog=EXIT_CODES_SHORT)
@server_options(allow_all=True)
@click.option("--checkpoints", "-c", is_flag=True, help="A row per checkpoint under each anchor.")
@json_option
def list_(targets: Targets, checkpoints: bool, as_json: bool) -> None:
    """List anchors in RAM and on disk."""

    def action(target: Target) -> dict[str, Any]:
        return {"server": target.name, "url": target.url, "entries": target.client().anchors()}

    for_each(targets, action, lambda results: show_entries(targets, results, as_json=as_json,
                                                           checkpoints=checkpoints, title="anchors"))


def _verb(name: str, call: Callable[[AdminClient, str], Any], done: str, help_text: str) -> click.Command:
    """pin/unpin/evict share one shape: an id (or the start of one, as docker takes them) in, the
    server's answer out."""

    @server_options()
    @click.argument("entry_id", shell_complete=entry_ids)
    @json_option
    def command(targets: list[Target], entry_id: str, as_json: bool) -> None:
        target = one(targets)
        with talking_to(target):
            client = target.client()
            entry_id = full_id(client, entry_id)
            answer = call(client, entry_id)
        if as_json:
            render.emit_json(answer)
        else:
            size = answer.freed_bytes if hasattr(answer, "freed_bytes") else answer.bytes  # Evicted, or EntryInfo
            click.echo(f"{target.name}: {done} {entry_id}" + (f" ({render.human_bytes(size)})" if size else ""))

    return anchors.command(name, help=help_text, epilog=EXIT_CODES_SHORT)(command)


_verb("pin", AdminClient.pin, "pinned", "Pin an entry in RAM as an anchor (kept until unpinned or evicted).")
_verb("unpin", AdminClient.unpin, "unpinned", "Unpin an anchor: it joins the conversation LRU.")
_verb("evict", AdminClient.evict, "evicted", "Evict an entry or anchor from RAM and disk (exit 5 if unknown).")


@anchors.command("new", epilog=EXIT_CODES_SHORT)
@server_options()
@click.option("--system-file", type=click.File("r"), required=True, help="The system prompt ('-' reads stdin).")
@click.option("--tools-file", type=click.File("r"), help="JSON list of OpenAI-style tools.")
@click.option("--tenant", help="The X-APC-Tenant the sessions send, if any.")
@click.option("--api-key", envvar="APCCTL_API_KEY", metavar="KEY",
              help="Make it in this inference API key's namespace, for the sessions that send the key (on a "
                   "server with --api-key); only the namespace's digest of the key is sent. [env: APCCTL_API_KEY]")
@json_option
def new(targets: list[Target], system_file: Any, tools_file: Any, tenant: str | None, api_key: str | None,
        as_json: bool) -> None:
    """Prefill a system prompt (+ tools) now and pin it, so the first session already hits.

    \b
    Example:
      apcctl anchors new --system-file prompts/agent.txt --tools-file tools.json
    """
    if api_key is not None:
        from server_patch.tenancy.namespace import key_identity, namespace

        tenant = namespace(key_identity(api_key.strip().encode("utf-8")), tenant, None)
    system = system_file.read()
    try:
        tools = json.load(tools_file) if tools_file else None
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--tools-file") from None
    if tools is not None and not isinstance(tools, list):
        raise click.BadParameter("must hold a JSON list of tools", param_hint="--tools-file")
    target = one(targets)
    with talking_to(target):
        answer = target.client().new_anchor(system, tools=tools, tenant=tenant)
    if as_json:
        render.emit_json(answer)
    else:
        anchor = answer.anchor
        click.echo(f"{target.name}: {'new' if answer.created else 'existing'} anchor {anchor.id} "
                   f"({anchor.length:,} tokens, {render.human_bytes(anchor.bytes)}), pinned")
