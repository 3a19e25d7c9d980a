"""The tiny model's MTP drafter, built once per session beside the shared tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_drafter_dir(tiny_model_dir: Path) -> Path:
    from apcctl.tinymodel.drafter import build_drafter

    return build_drafter(tiny_model_dir)
