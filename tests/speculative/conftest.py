"""The speculative pair: the ``tiny-spec`` target and its MTP drafter, built once per session.

Only these tests use ``tiny-spec``: its dominant path (what the constructed drafter follows) makes
the target repeat its last token's successor most of the time, so every other test keeps
``tiny_model_dir``'s context-driven ``tiny`` model for its warm == cold comparisons.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def spec_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from apcctl.lab.tinymodel.build import build_model

    return build_model(tmp_path_factory.mktemp("spec-model") / "tiny-spec", "tiny-spec", seed=0)


@pytest.fixture(scope="session")
def spec_drafter_dir(spec_model_dir: Path) -> Path:
    from apcctl.lab.tinymodel.drafter import build_drafter

    return build_drafter(spec_model_dir)
