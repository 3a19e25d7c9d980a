"""``apcctl model build --drafter``: a glm5_next_mtp checkpoint mlx-vlm's own loader accepts."""

from __future__ import annotations

import json
from pathlib import Path

from apcctl.lab.tinymodel.drafter import build_drafter, fit_report, is_drafter_built
from apcctl.lab.tinymodel.fingerprint import weights_fingerprint


def test_mlx_vlm_loads_the_drafter_as_an_mtp_drafter_of_its_target(spec_model_dir: Path, spec_drafter_dir: Path) -> None:
    from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility
    from mlx_vlm.utils import load_model

    drafter, kind = load_drafter(str(spec_drafter_dir))
    assert kind == "mtp"
    assert type(drafter).__name__ == "Glm5NextMTPDraftModel"
    validate_drafter_compatibility(load_model(spec_model_dir), drafter, kind)  # raises when incompatible
    config = json.loads((spec_drafter_dir / "config.json").read_text(encoding="utf-8"))
    target = json.loads((spec_model_dir / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "glm5_next_mtp"
    assert config["text_config"]["hidden_size"] == target["text_config"]["hidden_size"]


def test_the_drafter_leaves_the_target_and_its_fingerprint_alone(spec_model_dir: Path, spec_drafter_dir: Path) -> None:
    stamp = json.loads((spec_drafter_dir / ".apcctl-drafter.json").read_text(encoding="utf-8"))
    assert stamp["target_fingerprint"] == weights_fingerprint(spec_model_dir)
    assert not list(spec_model_dir.glob("mtp*.safetensors"))
    before = (spec_drafter_dir / "model.safetensors").stat().st_mtime_ns
    assert is_drafter_built(spec_model_dir)
    assert build_drafter(spec_model_dir) == spec_drafter_dir  # reused, not rebuilt
    assert (spec_drafter_dir / "model.safetensors").stat().st_mtime_ns == before


def test_the_fit_report_is_recorded(spec_model_dir: Path, spec_drafter_dir: Path) -> None:
    report = fit_report(spec_model_dir)
    assert report is not None and report["positions"] > 0
    assert 0.5 < report["greedy_agreement"] <= 1.0  # measured on the target's greedy tokens


def test_build_refuses_a_drafter_for_a_preset_without_the_path(tmp_path: Path) -> None:
    """tiny and bench have no dominant path (the correctness suite's models): a drafter built on
    one would draft what the target almost never says, so the CLI says which presets have it."""
    from click.testing import CliRunner

    from apcctl.cli import main

    done = CliRunner().invoke(main, ["model", "build", str(tmp_path / "m"), "--preset", "tiny", "--drafter"])
    assert done.exit_code == 2 and "tiny-spec" in done.output
    assert not (tmp_path / "m").exists()  # refused before building anything
