"""``apcctl model build --drafter``: a glm5_next_mtp checkpoint mlx-vlm's own loader accepts."""

from __future__ import annotations

import json
from pathlib import Path

from apcctl.tinymodel.drafter import build_drafter, fit_report, is_drafter_built
from apcctl.tinymodel.fingerprint import weights_fingerprint


def test_mlx_vlm_loads_the_drafter_as_an_mtp_drafter_of_its_target(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    from mlx_vlm.speculative.drafters import load_drafter, validate_drafter_compatibility
    from mlx_vlm.utils import load_model

    drafter, kind = load_drafter(str(tiny_drafter_dir))
    assert kind == "mtp"
    assert type(drafter).__name__ == "Glm5NextMTPDraftModel"
    validate_drafter_compatibility(load_model(tiny_model_dir), drafter, kind)  # raises when incompatible
    config = json.loads((tiny_drafter_dir / "config.json").read_text(encoding="utf-8"))
    target = json.loads((tiny_model_dir / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "glm5_next_mtp"
    assert config["text_config"]["hidden_size"] == target["text_config"]["hidden_size"]


def test_the_drafter_leaves_the_target_and_its_fingerprint_alone(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    stamp = json.loads((tiny_drafter_dir / ".apcctl-drafter.json").read_text(encoding="utf-8"))
    assert stamp["target_fingerprint"] == weights_fingerprint(tiny_model_dir)
    assert not list(tiny_model_dir.glob("mtp*.safetensors"))
    before = (tiny_drafter_dir / "model.safetensors").stat().st_mtime_ns
    assert is_drafter_built(tiny_model_dir)
    assert build_drafter(tiny_model_dir) == tiny_drafter_dir  # reused, not rebuilt
    assert (tiny_drafter_dir / "model.safetensors").stat().st_mtime_ns == before


def test_the_fit_report_is_recorded(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    report = fit_report(tiny_model_dir)
    assert report is not None and report["positions"] > 0
    assert 0.5 < report["greedy_agreement"] <= 1.0  # measured on the target's greedy tokens
