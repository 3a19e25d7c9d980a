"""``apcctl model``: build and fingerprint the random glm5_next models used by tests and benches."""

from __future__ import annotations

import json
from pathlib import Path

import click


def register(main: click.Group, bench: click.Group) -> None:
    del bench
    main.add_command(model)


@click.group()
def model() -> None:
    """Random glm5_next model directories (offline, deterministic by seed)."""


@model.command("build")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--preset", type=click.Choice(["tiny", "bench"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def build(out: Path, preset: str, seed: int) -> None:
    """Build a model into OUT (reused when OUT already holds this preset and seed)."""
    from apcctl.tiny_model import build_model, cache_bytes, weights_fingerprint

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


@model.command("fingerprint")
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def fingerprint(model_dir: Path, as_json: bool) -> None:
    """Print the sha256 over config.json and the weight files of MODEL_DIR."""
    from apcctl.tiny_model import weights_fingerprint

    try:
        digest = weights_fingerprint(model_dir)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps({"model_dir": str(model_dir), "fingerprint": digest}))
    else:
        click.echo(digest)
