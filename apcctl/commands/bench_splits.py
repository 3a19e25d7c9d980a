"""``apcctl bench splits``: how much a family's own cold prefill depends on where it is split."""

from __future__ import annotations

import json

import click


def _seeds(text: str) -> list[int]:
    """``0-4`` or ``0,2,5``."""
    try:
        if "-" in text:
            low, high = (int(x) for x in text.split("-", 1))
            return list(range(low, high + 1))
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: a range (0-4) or a list (0,2,5)", param_hint="--seeds") from None


@click.command("splits")
@click.option("--family", default="deepseek_v4", show_default=True,
              help="The tiny random model of this mlx-vlm family (apcctl.lab.tinymodel).")
@click.option("--seeds", default="0-2", show_default=True, help="Model and prompt seeds: 0-4 or 0,2,5.")
@click.option("--prompts", default=6, show_default=True, type=click.IntRange(1, 100), help="Prompts per seed.")
@click.option("--splits", default=4, show_default=True, type=click.IntRange(1, 50),
              help="Random split sets (and canary-chunked ones) per prompt.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench_splits(family: str, seeds: str, prompts: int, splits: int, as_json: bool) -> None:
    """Prefill random prompts in one call, with random cuts and with the canary's cuts, and
    report the worst logit difference between two split sets (absolute and over the logit
    scale), a one-wrong-token control, and the canary tolerance this family gets."""
    from apcctl.lab.bench.splits import measure_tiny
    from apcctl.lab.tinymodel.families import FAMILIES, NOT_SPLIT_INVARIANT
    from server_patch.canary.compare import SPLIT_RTOL

    if family not in FAMILIES and family not in NOT_SPLIT_INVARIANT:
        raise click.BadParameter(f"no tiny model for {family!r}", param_hint="--family")
    chosen = _seeds(seeds)
    results = measure_tiny(family, seeds=chosen, prompts=prompts, splits=splits)
    worst_rel = max(r.max_rel for r in results)
    extra = SPLIT_RTOL.get(family, 0.0)
    if as_json:
        click.echo(json.dumps({"family": family, "split_rtol": extra,
                               "seeds": {s: r.as_dict() for s, r in zip(chosen, results)}}, indent=2))
        return
    click.echo(f"{family}: split dependence of its own cold prefill (tiny float32 model)")
    for seed, r in zip(chosen, results):
        click.echo(f"  seed {seed}: {r.trials} pairs  max |diff| {r.max_abs:.3g}  max |diff|/scale "
                   f"{r.max_rel:.3g}  (scale {r.scale:.3g}; one wrong token: >= {r.wrong_min_abs:.3g})")
    covered = "covers" if extra >= worst_rel else "does NOT cover"
    click.echo(f"worst over the logit scale: {worst_rel:.3g}; canary split rtol for {family}: {extra:g} "
               f"({covered} it)")


def register(main: click.Group, bench: click.Group) -> None:
    bench.add_command(bench_splits)
