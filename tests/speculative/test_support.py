"""The start-up gate for drafters (server_patch.speculative.support): only proved pairs start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_patch.speculative.support import (
    check_drafter, draft_options, drafter_support, DraftOptions, UnservedDrafter,
)
from tests.server_harness import REPO_ROOT


def test_no_drafter_is_nothing_to_check(spec_model_dir: Path) -> None:
    assert check_drafter(str(spec_model_dir), draft_options(["--model", "m"], {})) is None


def test_the_tiny_mtp_drafter_is_served(spec_model_dir: Path, spec_drafter_dir: Path) -> None:
    options = draft_options(["--draft-model", str(spec_drafter_dir)], {})  # kind resolved from the drafter
    assert check_drafter(str(spec_model_dir), options) == "glm5_next + glm5_next_mtp (mtp)"
    env = {"MLX_VLM_DRAFT_MODEL": str(spec_drafter_dir), "MLX_VLM_DRAFT_KIND": "mtp"}
    assert check_drafter(str(spec_model_dir), draft_options([], env)) is not None


def test_quantized_kv_with_a_drafter_is_refused(spec_model_dir: Path, spec_drafter_dir: Path) -> None:
    with pytest.raises(UnservedDrafter, match="--kv-bits 8"):
        check_drafter(str(spec_model_dir), DraftOptions(str(spec_drafter_dir), "mtp"), kv_bits=8)


@pytest.mark.parametrize("case", ["other-kind", "hub-id", "native-layout", "kind-only"])
def test_unproved_combinations_are_refused_with_a_reason(case: str, spec_model_dir: Path, spec_drafter_dir: Path) -> None:
    options = {
        "other-kind": DraftOptions(str(spec_drafter_dir), "eagle3"),
        "hub-id": DraftOptions("someone/some-drafter", "mtp"),
        "native-layout": DraftOptions(str(spec_model_dir), "mtp"),
        "kind-only": DraftOptions(None, "mtp"),
    }[case]
    with pytest.raises(UnservedDrafter) as refused:
        check_drafter(str(spec_model_dir), options)
    reason = {"other-kind": "eagle3", "hub-id": "local directory", "native-layout": "split_mtp",
              "kind-only": "without --draft-model"}[case]
    assert reason in str(refused.value)


def test_model_check_view(spec_model_dir: Path, spec_drafter_dir: Path) -> None:
    assert drafter_support(str(spec_model_dir), str(spec_drafter_dir))["served"] is True
    refused = drafter_support(str(spec_model_dir), str(spec_drafter_dir), "dflash")
    assert refused["served"] is False and "dflash" in str(refused["reason"])


def test_the_launcher_refuses_before_loading_anything(spec_model_dir: Path, spec_drafter_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), APC_LINEAGE_DISK_PATH=str(tmp_path / "disk"),
               APC_STATE_DIR=str(tmp_path / "state"), XDG_STATE_HOME=str(tmp_path / "xdg"))
    done = subprocess.run(
        [sys.executable, "-m", "server_patch.launch", "--model", str(spec_model_dir), "--port", "9",
         "--draft-model", str(spec_drafter_dir), "--draft-kind", "dflash"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "not proved correct with the lineage cache" in done.stderr and "Traceback" not in done.stderr


def test_model_check_says_the_drafter_and_whether_it_is_served(spec_model_dir: Path, spec_drafter_dir: Path) -> None:
    import json

    from click.testing import CliRunner

    from apcctl.cli import main

    found = CliRunner().invoke(main, ["model", "check", str(spec_model_dir), "--json"])
    assert found.exit_code == 0, found.output
    drafter = json.loads(found.output)["drafter"]
    assert drafter["drafter"] == str(spec_drafter_dir) and drafter["served"] is True
    refused = CliRunner().invoke(main, ["model", "check", str(spec_model_dir), "--draft-model",
                                        str(spec_drafter_dir), "--draft-kind", "eagle3"])
    assert refused.exit_code == 1 and "refused at start" in refused.output


def test_logprobs_are_refused_only_while_a_drafter_speculates() -> None:
    from server_patch.speculative.support import logprobs_refusal, SPECULATING_ENV

    on = {SPECULATING_ENV: "glm5_next + glm5_next_mtp (mtp)"}
    assert logprobs_refusal("/v1/chat/completions", {"logprobs": True}, on)
    assert logprobs_refusal("/v1/completions", {"logprobs": 3}, on)
    assert logprobs_refusal("/v1/chat/completions", {"logprobs": False}, on) is None
    assert logprobs_refusal("/v1/chat/completions", {"logprobs": True}, {}) is None
