"""``apcctl model``: tiny glm5_next models for tests and benches, and the support checks
(``check`` a model directory before serving, ``matrix`` of every family in mlx-vlm)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from apcctl.lab.tinymodel.presets import PRESETS, SPEC_PRESETS


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(model)


@click.group()
def model() -> None:
    """Tiny model directories, and which models the lineage cache supports."""


@model.command("build")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(list(PRESETS)), default="tiny", show_default=True,
              help="tiny-spec and bench-spec: tiny's and bench's shapes with a dominant path a drafter can follow.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--drafter", is_flag=True,
              help="Also construct an MTP drafter into OUT/mtp (serve with --draft-model OUT/mtp --draft-kind mtp); "
                   f"only for {' and '.join(SPEC_PRESETS)}.")
def build(out: Path, preset: str, seed: int, drafter: bool) -> None:
    """Build a model into OUT (reused when OUT already holds this preset and seed)."""
    from apcctl.lab.tinymodel.build import build_model
    from apcctl.lab.tinymodel.config import cache_bytes
    from apcctl.lab.tinymodel.fingerprint import weights_fingerprint

    if drafter and preset not in SPEC_PRESETS:
        raise click.UsageError(f"--drafter follows the target's dominant path, which only "
                               f"{' and '.join(SPEC_PRESETS)} have; {preset} has none")
    try:
        path = build_model(out, preset=preset, seed=seed)
    except (FileExistsError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    at_16k = cache_bytes(config, 16384)
    click.echo(f"{path}  preset={preset} seed={seed}")
    click.echo(f"fingerprint {weights_fingerprint(path)}")
    click.echo(
        f"latent+index cache {at_16k.latent_and_index / 16384:,.0f} B/token "
        f"({at_16k.latent_and_index / 1e6:,.0f} MB at 16k), projected "
        f"{at_16k.projected / 16384:,.0f} B/token"
    )
    if drafter:
        from apcctl.lab.tinymodel.drafter import build_drafter, fit_report

        report = fit_report(build_drafter(path).parent) or {}
        click.echo(f"drafter {path / 'mtp'}  glm5_next_mtp, constructed on the target's dominant path; "
                   f"agrees with its greedy tokens {report.get('greedy_agreement', 0):.0%}")


@model.command("fingerprint")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def fingerprint(model_dir: Path, as_json: bool) -> None:
    """Print the sha256 over config.json and the weight files of MODEL_DIR."""
    from apcctl.lab.tinymodel.fingerprint import weights_fingerprint

    try:
        digest = weights_fingerprint(model_dir)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps({"model_dir": str(model_dir), "fingerprint": digest}))
    else:
        click.echo(digest)


@model.command("check")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--draft-model", type=click.Path(), default=None,
              help="The drafter to check (default: MODEL_DIR/mtp, or MTP tensors in the checkpoint).")
@click.option("--draft-kind", default=None, help="The --draft-kind the server would get.")
def check(model_dir: Path, as_json: bool, draft_model: str | None, draft_kind: str | None) -> None:
    """Before serving: is MODEL_DIR's cache layout one the lineage cache restores exactly?

    Reads only config.json: the model is built with placeholder weights (none are read, no
    memory is spent on them) and one 16-token forward fills its real caches. Prints every
    layer's cache class, restore rule, KV bytes per token and snapshot bytes, and the drafter
    (found or given) with whether the lineage serves it. Exit code 1 when the layout is not
    supported or a given drafter is not served (the server would refuse either at start).
    """
    from apcctl.lab.model_check import check_model_dir, format_report

    try:
        report = check_model_dir(model_dir)
    except (FileNotFoundError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise click.ClickException(f"cannot build {model_dir} from its config.json: "
                                   f"{type(exc).__name__}: {exc}") from exc
    from apcctl.lab.drafter_check import drafter_report, format_drafter

    drafter = drafter_report(model_dir, draft_model, draft_kind)
    if as_json:
        click.echo(json.dumps({**report.as_dict(), "drafter": drafter}, indent=2))
    else:
        click.echo(format_report(report))
        click.echo(format_drafter(drafter))
    if not report.supported or (drafter["given"] and not drafter["served"]):
        raise SystemExit(1)


@model.command("matrix")
@click.option("--markdown", is_flag=True, help="Print docs/models.md.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def matrix(markdown: bool, as_json: bool) -> None:
    """Every model family of the installed mlx-vlm: its cache classes and who restores them."""
    from apcctl.lab.model_matrix import matrix_rows, render_markdown, rows_as_dicts

    rows = matrix_rows()
    if markdown:
        click.echo(render_markdown(rows), nl=False)
    elif as_json:
        click.echo(json.dumps(rows_as_dicts(rows), indent=2))
    else:
        for r in rows:
            click.echo(f"{r.family:<28} {r.layers:<15} {r.path:<22} {r.classes}")
