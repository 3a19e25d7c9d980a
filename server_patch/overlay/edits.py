"""The data model of the patch: exact-text edits against pristine mlx-vlm files.

Why exact text: an edit that matches exactly once in a file whose sha256 we pinned cannot land
in the wrong place, and a file that changed fails loudly before anything is installed, never
as a half-patched server. Topics (``server_patch/overlay/patches/<topic>.py``) contribute
edits; several topics may edit the same file as long as their edits do not overlap.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from server_patch import MLX_VLM_VERSION


class PatchError(RuntimeError):
    """An edit or file does not match the pristine source; nothing may be installed."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems or (message,)


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (which must occur exactly once in the pristine file) by ``new``."""

    name: str
    old: str
    new: str

    def __post_init__(self) -> None:
        if not self.old:
            raise PatchError(f"edit {self.name!r} has an empty anchor")


@dataclass(frozen=True)
class FilePatch:
    """Every edit to one module, pinned to the sha256 of its pristine file.

    ``relpath`` is relative to the directory holding the top-level package (site-packages).
    ``dist``/``version`` name the distribution the pristine file comes from; ``dist=None``
    skips the installed-version check (test fixtures that are not a distribution).
    """

    module: str
    relpath: str
    sha256: str
    edits: tuple[Edit, ...]
    dist: str | None = "mlx-vlm"
    version: str = MLX_VLM_VERSION

    def __post_init__(self) -> None:
        stem = self.module.replace(".", "/")
        if self.relpath not in (f"{stem}.py", f"{stem}/__init__.py"):
            raise PatchError(f"{self.relpath} is not the file of module {self.module}")
        names = [edit.name for edit in self.edits]
        if len(names) != len(set(names)):
            raise PatchError(f"duplicate edit names in {self.relpath}: {sorted(names)}")


def register(file_patch: FilePatch, registry: dict[str, FilePatch]) -> FilePatch:
    """Add a topic's edits to ``registry``; edits for a module already there are merged.

    Registering the same edit twice is a no-op (two topics may share an edit); the same edit
    name with different text, or topics pinning different hashes, is an error.
    """
    existing = registry.get(file_patch.module)
    if existing is None:
        registry[file_patch.module] = file_patch
        return file_patch
    if (existing.relpath, existing.sha256, existing.dist, existing.version) != (
        file_patch.relpath, file_patch.sha256, file_patch.dist, file_patch.version
    ):
        raise PatchError(f"topics disagree about the pristine {file_patch.relpath} (sha256/version)")
    merged = list(existing.edits)
    by_name = {edit.name: edit for edit in merged}
    for edit in file_patch.edits:
        known = by_name.get(edit.name)
        if known == edit:
            continue
        if known is not None:
            raise PatchError(f"edit {edit.name!r} in {file_patch.relpath} registered twice with different text")
        merged.append(edit)
        by_name[edit.name] = edit
    registry[file_patch.module] = replace(existing, edits=tuple(merged))
    return registry[file_patch.module]


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _occurrences(text: str, needle: str) -> list[int]:
    """Start offsets of every occurrence, overlapping ones included."""
    found, start = [], text.find(needle)
    while start != -1:
        found.append(start)
        start = text.find(needle, start + 1)
    return found


def locate(patch: FilePatch, text: str) -> list[tuple[int, int, Edit]]:
    """Where each edit lands in ``text``, sorted; every problem found is reported at once."""
    problems, spans = [], []
    for edit in patch.edits:
        starts = _occurrences(text, edit.old)
        if len(starts) != 1:
            problems.append(f"edit {edit.name!r} in {patch.relpath} matched {len(starts)} times")
        else:
            spans.append((starts[0], starts[0] + len(edit.old), edit))
    spans.sort(key=lambda span: span[:2])
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            problems.append(f"edits {first.name!r} and {second.name!r} in {patch.relpath} overlap")
    if problems:
        raise PatchError("; ".join(problems), tuple(problems))
    return spans


def apply(patch: FilePatch, text: str) -> str:
    """The patched source: checks the pristine hash, then applies every edit at once."""
    found = sha256_text(text)
    if found != patch.sha256:
        raise PatchError(
            f"sha256 mismatch: installed {patch.dist or patch.module} is not "
            f"{patch.version if patch.dist else 'the pristine copy'} ({patch.relpath}: expected "
            f"{patch.sha256[:16]}..., found {found[:16]}...); refusing to patch"
        )
    out, cursor = [], 0
    for start, end, edit in locate(patch, text):
        out.append(text[cursor:start])
        out.append(edit.new)
        cursor = end
    out.append(text[cursor:])
    return "".join(out)
