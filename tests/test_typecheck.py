"""The type checker and the linter, run on the tree as CI runs the suite (issue 35).

mypy (pinned in the test extra) checks what ``[tool.mypy]`` in pyproject.toml names: strict on
the lineage policy (``server_patch.lineage``), the copy ledger (``server_patch.observe``) and
the HTTP plumbing (``server_patch.infra``: token, ASGI gate, traffic gate), the packages whose
params and results every other part builds on, and on the request's session and door
(``server_patch.integration``) and the copy-free buffers (``server_patch.copyfree``), typed
with the real classes (``Any`` only for mlx-vlm's untyped objects). ruff checks the whole tree
with a small rule set (syntax errors and pyflakes: unused imports, undefined names). Both read
their settings from pyproject.toml, so running ``mypy`` or ``ruff check`` by hand gives the
same answer as this test.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRICT = ("server_patch.lineage.*", "server_patch.observe.*", "server_patch.infra.*", "server_patch.integration.*",
          "server_patch.copyfree.*")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=900)


def test_the_config_keeps_the_policy_strict():
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    strict = {m for o in config["overrides"] if o.get("strict") for m in o["module"]}
    assert set(STRICT) <= strict, strict


def test_mypy_finds_no_type_errors():
    out = _run("mypy")
    assert out.returncode == 0, out.stdout + out.stderr
    checked = re.search(r"no issues found in (\d+) source files", out.stdout)
    assert checked and int(checked.group(1)) >= 15, out.stdout  # the policy's modules were checked


def test_ruff_finds_nothing():
    out = _run("ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr
