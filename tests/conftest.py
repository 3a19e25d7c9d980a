"""Shared fixtures: one tiny random glm5_next model directory per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``apcctl.tiny_model`` preset "tiny", seed 0, built once (about a second) and reused."""
    from apcctl.tiny_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny-model") / "tiny", "tiny", seed=0)
