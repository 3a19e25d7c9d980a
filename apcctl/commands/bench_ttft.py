"""``apcctl bench ttft``: warm-turn time to first token, stock and patched (reply reuse on and off).

The bench itself is ``apcctl.lab.bench.ttft`` (servers, turns, the split read from
``/admin/requests`` and mlx-vlm's ``/metrics``), ``apcctl.lab.bench.ttft_forward`` (the suffix
forward in-process) and ``apcctl.lab.bench.ttft_report`` (tables). Not a test: nothing asserts a time.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click

from apcctl.commands.against import against_option, against_tree

DEFAULT_CONTEXT = 4096  # 16384 works too; the cold prefill of the bench preset is slow on a CPU


def register(main: click.Group, bench: click.Group) -> None:
    del main
    bench.add_command(ttft)


@click.command("ttft")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A model directory, used as it is when it holds a config.json (default: the bench "
                   "preset, built once in a temp cache dir).")
@click.option("--context", default=DEFAULT_CONTEXT, show_default=True, type=click.IntRange(16),
              help="Tokens of the conversation.")
@click.option("--questions", default=6, show_default=True, type=click.IntRange(1), help="Warm turns after the cold one.")
@click.option("--max-tokens", default=4, show_default=True, type=click.IntRange(1), help="Reply length of every turn.")
@click.option("--modes", default="stock,patched,patched-reuse-off", show_default=True,
              help="Servers to run, in order: stock, patched (reply reuse on), patched-reuse-off.")
@click.option("--repeat", default=5, show_default=True, type=click.IntRange(0),
              help="Timed suffix forwards (median); 0 skips the in-process forward.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the server logs and counter files here (default: a temp dir).")
@click.option("--startup-timeout", default=300.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the tables.")
@against_option
def ttft(model_dir: Path | None, context: int, questions: int, max_tokens: int, modes: str, repeat: int,
         workdir: Path | None, startup_timeout: float, as_json: bool, against_ref: str | None) -> None:
    """Warm-turn time to first token, tokens restored and prefilled, KV bytes copied per turn."""
    from apcctl.lab.bench import ttft as bench
    from apcctl.lab.bench.against import compare_ttft, ttft_lines
    from apcctl.lab.bench.ttft_report import render
    from apcctl.lab.tinymodel.build import build_model

    selected = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = sorted(set(selected) - set(bench.MODES))
    if unknown or not selected:
        raise click.BadParameter(f"unknown mode(s) {', '.join(unknown) or '(none)'}; "
                                 f"known: {', '.join(bench.MODES)}", param_hint="--modes")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="apcctl-ttft-"))
    workdir.mkdir(parents=True, exist_ok=True)
    echo = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    with against_tree(against_ref, workdir) as other:
        if model_dir is None or not (model_dir / "config.json").is_file():
            model_dir = build_model(model_dir or Path(tempfile.gettempdir()) / "apcctl-bench-model", preset="bench",
                                    seed=0)
        trees = {other.mode: other.tree} if other else {}
        selected += [m for m in ("patched", *trees) if trees and m not in selected]
        try:
            result = bench.run(model_dir, selected, context, questions, max_tokens, repeat, workdir,
                               startup_timeout, echo, trees)
        except bench.BenchError as exc:
            raise click.ClickException(str(exc)) from None
    if other:
        result["against"] = {"ref": other.ref, "commit": other.commit, **compare_ttft(result, other.mode)}
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(render(result))
        if other:
            click.echo("\n".join(ttft_lines(result["against"])))
        click.echo(f"logs and counter files: {workdir} (load average {os.getloadavg()[0]:.1f})")
