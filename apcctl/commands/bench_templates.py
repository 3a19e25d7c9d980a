"""``apcctl bench templates``: does the next prompt re-render the generated reply verbatim?"""

from __future__ import annotations

import json

import click


@click.command("templates")
@click.option("--variant", "variants", multiple=True, metavar="NAME",
              help="Only these template variants (repeatable); default: all, the tiny model's included.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench_templates(variants: tuple[str, ...], as_json: bool) -> None:
    """Render conversations with real chat templates (no weights) and report, per template and
    case, whether turn k+1's prompt starts with turn k's prompt + generated reply, or where not."""
    from rich.console import Console
    from rich.table import Table

    from apcctl.lab.sim import template_study as ts

    known = {v.name: v for v in (*ts.VARIANTS, *ts.TINY_VARIANTS)}
    unknown = [name for name in variants if name not in known]
    if unknown:
        raise click.BadParameter(f"unknown {', '.join(unknown)}; known: {', '.join(known)}",
                                 param_hint="--variant")
    chosen = tuple(known[name] for name in variants) if variants else tuple(known.values())
    errors: list[str] = []
    results = ts.study(chosen, on_error=lambda v, c, e: errors.append(f"{v.name} × {c.name}: {e}"))
    if as_json:
        click.echo(json.dumps({"results": [{
            "variant": r.variant, "case": r.case, "verbatim": r.verbatim, "diverges_at": r.diverges_at,
            "prompt_chars": r.prompt_len, "reply_chars": len(r.generated),
            "reply_chars_kept": r.reply_chars_kept, "reason": r.reason} for r in results],
            "errors": errors}, indent=2))
    else:
        table = Table(title="Turn k+1's prompt against turn k's prompt + generated reply (characters)",
                      title_justify="left")
        for name in ("template", "case", "verdict", "why"):
            table.add_column(name)
        for r in results:
            table.add_row(r.variant, r.case, r.verdict(), r.reason)
        console = Console() if Console().is_terminal else Console(width=160)
        console.print(table)
        for line in errors:
            click.echo(f"error: {line}", err=True)
    if errors:
        raise SystemExit(1)


def register(main: click.Group, bench: click.Group) -> None:
    bench.add_command(bench_templates)
