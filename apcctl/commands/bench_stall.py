"""``apcctl bench stall``: how long a decoding stream stalls for another session's cache work.

The bench itself is ``apcctl.lab.bench.stall``; stock and patched run side by side. Not a test:
nothing asserts a time.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from apcctl.commands.against import against_option, against_tree

QUICK = {"preset": "tiny", "context": 600, "tokens": 24, "commits": 3, "repeat": 1}
FULL = {"preset": "bench", "context": 4096, "tokens": 120, "commits": 5, "repeat": 3}
SCENARIOS = ("cold-prefill,ram-restore,ram-lent,disk-restore,shared-row-end,short-visits,full-budget,"
             "full-budget-normal,canary-load")


def register(main: click.Group, bench: click.Group) -> None:
    del main
    bench.add_command(stall)


@click.command("stall")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A model directory (default: the bench preset, or the tiny one with --quick, built "
                   "once in a temp cache dir).")
@click.option("--quick", is_flag=True, help="The tiny model and small sizes (a smoke run, a minute on a CPU).")
@click.option("--context", type=click.IntRange(16), default=None,
              help=f"Tokens of the other session's conversation [{FULL['context']}; quick {QUICK['context']}].")
@click.option("--tokens", type=click.IntRange(2), default=None,
              help=f"The victim stream's reply length [{FULL['tokens']}; quick {QUICK['tokens']}].")
@click.option("--commits", type=click.IntRange(1), default=None,
              help=f"Conversations committed in full-budget(-normal) [{FULL['commits']}; quick {QUICK['commits']}].")
@click.option("--repeat", type=click.IntRange(1), default=None,
              help=f"canary-load: TTFT samples alone and with the canary loading [{FULL['repeat']}; "
                   f"quick {QUICK['repeat']}].")
@click.option("--modes", default="stock,patched,patched-unpaced", show_default=True,
              help="Servers to run, in order: stock, patched, patched-unpaced (decode-aware prefill off; "
                   "only the scenarios whose event prefills), patched-stock-join (mlx-vlm's own join and "
                   "leave, APC_COPYFREE_JOIN=0), patched-stock-grow (mlx-vlm's own regrow of a decoding "
                   "batch's buffer, APC_COPYFREE_GROW=0).")
@click.option("--scenarios", default=SCENARIOS, show_default=True,
              help="Which events to run in the other session.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the server logs here (default: a temp dir).")
@click.option("--startup-timeout", default=300.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@against_option
def stall(model_dir: Path | None, quick: bool, context: int | None, tokens: int | None, commits: int | None,
          repeat: int | None, modes: str, scenarios: str, workdir: Path | None, startup_timeout: float,
          as_json: bool, against_ref: str | None) -> None:
    """A stream's inter-token gaps (p50/p99/max) alone and while another session restores,
    prefills, ends a shared row or commits under a full budget, a long stream's while short
    requests join and leave its batch, and a request's TTFT while the canary loads a disk point;
    stock and patched side by side."""
    from apcctl.lab.bench import stall as bench
    from apcctl.lab.bench.against import compare_stall, stall_lines
    from apcctl.lab.bench.ttft import BenchError
    from apcctl.lab.tinymodel.build import build_model

    sizes = QUICK if quick else FULL
    chosen_modes = _names(modes, list(bench.MODES), "--modes")
    chosen = _names(scenarios, list(bench.SCENARIOS), "--scenarios")
    plan = bench.Plan(context=context or sizes["context"], tokens=tokens or sizes["tokens"],
                      commits=commits or sizes["commits"], repeat=repeat or int(sizes["repeat"]))
    preset = str(sizes["preset"])
    model_dir = build_model(model_dir or Path(tempfile.gettempdir()) / f"apcctl-{preset}-model", preset=preset, seed=0)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="apcctl-stall-"))
    workdir.mkdir(parents=True, exist_ok=True)
    echo = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    with against_tree(against_ref, workdir) as other:
        trees = {other.mode: other.tree} if other else {}
        chosen_modes += [m for m in ("patched", *trees) if trees and m not in chosen_modes]
        try:
            result = bench.run(model_dir, chosen_modes, chosen, plan, workdir, startup_timeout, echo, trees)
        except BenchError as exc:
            raise click.ClickException(str(exc)) from None
    if other:
        result["against"] = {"ref": other.ref, "commit": other.commit, **compare_stall(result, other.mode)}
    click.echo(json.dumps(result) if as_json else "\n".join(
        [bench.render(result), *(stall_lines(result["against"]) if other else [])]))


def _names(raw: str, known: list[str], hint: str) -> list[str]:
    chosen = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        raise click.BadParameter(f"unknown {', '.join(unknown) or '(none)'}; known: {', '.join(known)}",
                                 param_hint=hint)
    return chosen
