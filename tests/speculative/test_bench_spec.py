"""``apcctl bench spec`` runs both sides on real servers and their replies agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from apcctl.cli import main


@pytest.mark.server
def test_bench_spec_side_by_side(spec_model_dir: Path, spec_drafter_dir: Path, tmp_path: Path) -> None:
    done = CliRunner().invoke(main, ["bench", "spec", "--model", str(spec_model_dir), "--preset", "tiny-spec",
                                     "--context", "300", "--questions", "1", "--max-tokens", "8",
                                     "--workdir", str(tmp_path), "--json"])
    assert done.exit_code == 0, done.output
    result = json.loads(done.output.strip().splitlines()[-1])
    assert result["replies_equal"] == [True, True]
    off, mtp = (result["sides"][side]["turns"] for side in ("off", "mtp"))
    assert [t["kind"] for t in off] == [t["kind"] for t in mtp] == ["cold", "entry"]
    assert all(t["drafted"] > 0 for t in mtp) and not any(t["drafted"] for t in off)
    assert sum(t["accepted"] for t in mtp) > 0  # the constructed drafter's drafts are accepted
