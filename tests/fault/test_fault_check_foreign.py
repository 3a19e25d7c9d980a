"""Issue 34 item 3: ``apcctl check --fix`` pointed at a models directory deleted the weights.

Only files in the per-fingerprint subdirectories of a directory carrying the tier's marker (or
an earlier version's tier layout) are candidates; anything else is foreign and never removed,
and ``--fix`` refuses a directory that is not a tier. Real ``DiskStore`` files, a real
safetensors model file (mlx's own writer), the real click command.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from apcctl.cli import main
from server_patch.disk.lock import LOCK_NAME
from server_patch.disk.marker import MARKER_NAME, is_tier
from tests.cli.test_check_cli import flip_data_byte
from tests.disk.test_disk_store import written

FINGERPRINT = "0123456789abcdef" + "0" * 48


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["check", *args])
    return result.exit_code, result.output


def model_dir(path: Path) -> Path:
    """What a downloaded MLX model directory looks like: config and weights at the top."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen3"}')
    mx.save_safetensors(str(path / "model.safetensors"), {"w": mx.zeros((4, 4))}, metadata={"format": "mlx"})
    return path


@pytest.fixture
def tier(tmp_path, model, layout, monkeypatch) -> Path:
    monkeypatch.delenv("APC_LINEAGE_DISK_PATH", raising=False)
    root = tmp_path / "lineage"
    written(root / FINGERPRINT[:16], model, layout, seed=91, fingerprint=FINGERPRINT)
    return root


def test_fix_refuses_a_models_directory_and_removes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("APC_LINEAGE_DISK_PATH", raising=False)
    models = model_dir(tmp_path / "models" / "Qwen3-0.6B")
    for where in (models, models.parent):
        code, out = run("--disk-path", str(where), "--fix")
        assert code == 2 and "refusing --fix" in out and "not a lineage disk directory" in out, out
    assert (models / "model.safetensors").exists()
    assert not (models / LOCK_NAME).exists() and not (models / MARKER_NAME).exists()  # nothing written there

    code, out = run("--disk-path", str(models))  # a plain check says why, checks and removes nothing
    assert code == 2 and f"foreign (not the server's, never removed): {models / 'model.safetensors'}" in out, out
    assert "damaged" not in out.replace("0 damaged", "")


def test_the_store_marks_its_tier_private(tier):
    marker = tier / MARKER_NAME
    assert marker.is_file() and stat.S_IMODE(marker.stat().st_mode) == 0o600
    assert is_tier(tier)


def test_foreign_files_in_a_tier_are_listed_never_removed(tier, tmp_path):
    (ours,) = list((tier / FINGERPRINT[:16]).glob("*.safetensors"))
    flip_data_byte(ours)
    model_dir(tier / "stray-model")  # a model copied into the tier: a subdirectory that is no fingerprint's
    stray_top = tier / "weights.safetensors"
    stray_top.write_bytes((tier / "stray-model" / "model.safetensors").read_bytes())
    code, out = run("--disk-path", str(tier), "--fix", "--json")
    report = json.loads(out)
    assert code == 1 and [f["path"] for f in report["damaged"]] == [str(ours)], out
    assert sorted(report["foreign"]) == sorted([str(stray_top), str(tier / "stray-model" / "model.safetensors")])
    assert not ours.exists()
    assert stray_top.exists() and (tier / "stray-model" / "model.safetensors").exists()


def test_a_tier_of_an_earlier_version_is_recognised_by_its_layout(tier):
    """Earlier servers wrote no marker but always created ``.lock``: the upgrade must not strand them."""
    (tier / MARKER_NAME).unlink()
    (tier / LOCK_NAME).write_text("")
    (ours,) = list((tier / FINGERPRINT[:16]).glob("*.safetensors"))
    flip_data_byte(ours)
    code, out = run("--disk-path", str(tier), "--fix")
    assert code == 1 and f"removed: {ours}" in out, out


def test_the_layout_rule_does_not_match_a_models_directory(tier):
    """A ``.lock`` left by an earlier ``check --fix`` in a models directory does not make it a tier."""
    (tier / MARKER_NAME).unlink()
    (tier / LOCK_NAME).write_text("")
    (tier / "config.json").write_text("{}")
    assert not is_tier(tier)
    (ours,) = list((tier / FINGERPRINT[:16]).glob("*.safetensors"))
    code, out = run("--disk-path", str(tier), "--fix")
    assert code == 2 and ours.exists(), out
