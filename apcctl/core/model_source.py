"""Is a ``--model`` value a local directory or a Hugging Face repo id, and is it usable?

Checked before a server is started, because mlx-vlm reads a missing local path as a repo id and
the server dies at start with a traceback ending in "Repo id must be in the form ...".
"""

from __future__ import annotations

import re
from pathlib import Path

# ``name`` or ``namespace/name`` as the Hugging Face Hub spells them (no leading ``.``, ``~`` or ``/``).
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def looks_like_path(model: str) -> bool:
    """A value the Hub could never take for a repo id: absolute, ``~``, ``./``, ``../``, or more
    than one ``/``."""
    return not REPO_ID.match(model) or model.startswith((".", "~"))


def model_problem(model: str) -> str | None:
    """Why ``model`` cannot be served, said as an operator fixes it; None when it can (a local
    directory that exists, or a repo id the server downloads or finds in its cache)."""
    path = Path(model).expanduser()
    if path.exists():
        return None if path.is_dir() else f"model directory {path} is a file, not a directory"
    if looks_like_path(model):
        return f"model directory {path} does not exist"
    return None


def weights_problem(model: str) -> str | None:
    """Why a local model directory cannot load: no ``*.safetensors`` weights (mlx-vlm's load then
    fails with "No safetensors found in ...", and prints its conversion help after it); None for
    a directory with weights or a repo id. ``serve`` and ``restart``'s plan check it before a
    server is started or stopped."""
    path = Path(model).expanduser()
    if not path.is_dir() or any(w.name != "consolidated.safetensors" for w in path.glob("*.safetensors")):
        return None
    return f"model directory {path} has no *.safetensors weights (mlx-vlm would fail: No safetensors found)"
