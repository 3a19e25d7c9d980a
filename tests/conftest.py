"""Shared fixtures: one tiny random glm5_next model directory per test session."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

# Some images set PYTHONDONTWRITEBYTECODE (this machine's does): every one of the suite's Python
# processes (the pytest workers, ~160 servers, the CLI runs) then compiled the project's modules
# from source again (server_patch's alone: 0.24 s of CPU each), and pytest could not cache its
# assertion rewrites. The suite writes bytecode as Python does by default, for itself and (through
# ``private_home``) for the processes it starts; the caches land in the tree's ignored __pycache__.
sys.dont_write_bytecode = False


# Where the user's real state, config and caches live when these are unset: every test runs with
# them pointed at one private tree (``private_home``), so no test reads a record of a server the
# developer started, a config file or a cache.
HOME_VARIABLES = ("HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME",
                  "XDG_RUNTIME_DIR")


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """HOME and the XDG dirs under a session tmp dir, and the CLI's variables from the developer's
    shell cleared (and PYTHONDONTWRITEBYTECODE: see above), before any fixture (module fixtures
    included) or test runs."""
    root = tmp_path_factory.mktemp("home")
    patch = pytest.MonkeyPatch()
    for key in HOME_VARIABLES:
        (root / key.lower()).mkdir(mode=0o700)
        patch.setenv(key, str(root / key.lower()))
    for key in (*CLI_ENV_CLEARED, "APC_STATE_DIR", "PYTHONDONTWRITEBYTECODE"):
        patch.delenv(key, raising=False)
    try:
        yield root
    finally:
        patch.undo()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``apcctl.lab.tinymodel.build`` preset "tiny", seed 0, built once (a few seconds) and reused."""
    from apcctl.lab.tinymodel.build import build_model

    return build_model(tmp_path_factory.mktemp("tiny-model") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def model():
    """The in-process kilobyte-sized glm5_next language model of ``fake_model``."""
    from tests.fake_model import tiny_language_model

    return tiny_language_model(seed=0)


@pytest.fixture(scope="module")
def layout(model):
    """The cache layout of ``model``."""
    from server_patch.state.layout import CacheLayout

    return CacheLayout.from_model(model)


# Variables from the developer's shell that would point the CLI at a real server, token or cache.
CLI_ENV_CLEARED = ("APCCTL_SERVER", "APCCTL_TOKEN", "APCCTL_CONFIG", "APC_ADMIN_TOKEN", "APC_ADMIN_TOKEN_FILE",
                   "APC_LINEAGE_DISK_PATH", "APC_JOURNAL_DIR", "APC_LOG_FILE", "APC_LINEAGE_RAM_BUDGET_BYTES",
                   "APC_LINEAGE_DISK_MAX_BYTES", "APC_API_KEYS", "APC_API_KEY_FILE", "MLX_VLM_SERVER_API_KEY",
                   "APC_SHARED_DISK_PATH")


def isolate_cli(patch: pytest.MonkeyPatch, root: Path) -> Path:
    """Private state and config dirs under ``root``; nothing from the developer's shell."""
    patch.setenv("APC_STATE_DIR", str(root / "state"))
    patch.setenv("XDG_CONFIG_HOME", str(root / "xdg"))
    patch.setenv("HF_HUB_OFFLINE", "1")
    for key in CLI_ENV_CLEARED:
        patch.delenv(key, raising=False)
    return root


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private state dir and config dir for the module; managed servers are stopped at the end."""
    root = tmp_path_factory.mktemp("cli")
    patch = pytest.MonkeyPatch()
    isolate_cli(patch, root)
    patch.setenv("APC_JOURNAL_SNAPSHOT_S", "0")  # a budget snapshot with every event: report has a series
    try:
        yield root
    finally:
        from click.testing import CliRunner

        from apcctl.cli import main

        CliRunner().invoke(main, ["stop", "--all", "--grace", "10"])
        patch.undo()
