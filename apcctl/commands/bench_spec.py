"""``apcctl bench spec``: warm turns without and with the MTP drafter, side by side (issue 39)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from apcctl.lab.tinymodel.presets import SPEC_PRESETS


def register(main: click.Group, bench: click.Group) -> None:
    del main
    bench.add_command(spec)


@click.command("spec")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A model directory built by apcctl (default: the preset, built once in a temp cache dir).")
@click.option("--preset", type=click.Choice(list(SPEC_PRESETS)), default="bench-spec", show_default=True,
              help="A preset with a dominant path, so the constructed drafter's drafts get accepted.")
@click.option("--context", default=2048, show_default=True, type=click.IntRange(16), help="Tokens of the conversation.")
@click.option("--questions", default=4, show_default=True, type=click.IntRange(1), help="Warm turns after the cold one.")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1), help="Reply length of every turn.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the server logs here (default: a temp dir).")
@click.option("--startup-timeout", default=300.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def spec(model_dir: Path | None, preset: str, context: int, questions: int, max_tokens: int,
         workdir: Path | None, startup_timeout: float, as_json: bool) -> None:
    """Warm TTFT, decode tokens/s, accepted drafts per round and prefilled tokens, drafter off and on."""
    from apcctl.lab.bench import spec as bench
    from apcctl.lab.tinymodel.build import build_model
    from apcctl.lab.tinymodel.drafter import build_drafter

    model_dir = build_model(model_dir or Path(tempfile.gettempdir()) / f"apcctl-{preset}-model", preset=preset, seed=0)
    drafter = build_drafter(model_dir)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="apcctl-spec-"))
    echo = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    try:
        result = bench.run(model_dir, drafter, context, questions, max_tokens, workdir, startup_timeout, echo)
    except bench.BenchError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(result) if as_json else bench.render(result))
