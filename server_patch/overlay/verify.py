"""Read the installed pristine files and check every registered patch against them.

Everything here runs before the import hook is installed, so a mismatch stops the launcher
with a message naming the file and the edit instead of serving a half-patched mlx-vlm.
Files are located without importing the package they belong to (importing
``mlx_vlm.server`` would import the very modules we patch).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping
from pathlib import Path

from server_patch.overlay.edits import FilePatch, PatchError, apply


def installed_path(patch: FilePatch) -> Path:
    """The file the import system would load for ``patch.module``."""
    top = patch.module.split(".", 1)[0]
    spec = importlib.util.find_spec(top)  # a top-level lookup imports nothing
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"package {top!r} is not installed (needed by {patch.relpath})")
    root = Path(next(iter(spec.submodule_search_locations))).parent
    return root / patch.relpath


def pristine_text(patch: FilePatch) -> str:
    """The installed file's text, byte for byte (no newline translation)."""
    path = installed_path(patch)
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise PatchError(f"cannot read {path} for {patch.relpath}: {exc}") from exc


def check_versions(registry: Mapping[str, FilePatch]) -> list[str]:
    """Problems with the installed distributions the patches were written against."""
    problems = []
    for dist, version in sorted({(p.dist, p.version) for p in registry.values() if p.dist}):
        try:
            found = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{dist} is not installed; the patch needs {dist}=={version}")
            continue
        if found != version:
            problems.append(f"installed {dist} is {found}, the patch needs exactly {version}")
    return problems


def verify_all(registry: Mapping[str, FilePatch] | None = None) -> dict[str, str]:
    """Patched sources by module; raises one PatchError listing every problem found."""
    if registry is None:
        from server_patch.overlay.patches import load_topics

        registry = load_topics()
    problems = check_versions(registry)
    patched: dict[str, str] = {}
    for module in sorted(registry):
        try:
            patched[module] = apply(registry[module], pristine_text(registry[module]))
        except PatchError as exc:
            problems.extend(exc.problems)
    if problems:
        raise PatchError("patch does not apply:\n  " + "\n  ".join(problems), tuple(problems))
    return patched
