"""The import hook: patched modules are compiled from edited source, the rest load normally.

A ``MetaPathFinder`` first on ``sys.meta_path`` answers only for module names that have
edits. It finds the installed file the way the normal path finder would, checks its sha256,
applies the edits, and compiles the result under the installed file's name, so tracebacks
and ``inspect`` point at the real file; ``linecache`` is primed with the patched lines so
the line numbers in a traceback show the code that actually ran. Nothing on disk changes
and no bytecode is read or written for patched modules (the loader compiles from text).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from server_patch.overlay.edits import FilePatch, PatchError, apply


class OverlayLoader(importlib.abc.InspectLoader):
    """Executes one module from its patched source text."""

    def __init__(self, patch: FilePatch, origin: str, source: str) -> None:
        self.patch = patch
        self.origin = origin
        self.source = source

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # default module creation

    def exec_module(self, module: ModuleType) -> None:
        code = compile(self.source, self.origin, "exec", dont_inherit=True)
        _prime_linecache(self.origin, self.source)
        exec(code, module.__dict__)

    def get_source(self, fullname: str) -> str:
        return self.source

    def is_package(self, fullname: str) -> bool:
        return self.patch.relpath.endswith("/__init__.py")


def _prime_linecache(filename: str, source: str) -> None:
    """Let tracebacks show the patched lines; the entry survives ``checkcache`` because it
    carries the file's real size and mtime."""
    try:
        stat = os.stat(filename)
    except OSError:
        return
    linecache.cache[filename] = (stat.st_size, stat.st_mtime, source.splitlines(True), filename)


class OverlayFinder(importlib.abc.MetaPathFinder):
    """Finds the modules named in ``registry`` and hands them to an :class:`OverlayLoader`."""

    def __init__(self, registry: Mapping[str, FilePatch]) -> None:
        self.registry = dict(registry)
        self.loaded: list[str] = []

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[override]
        patch = self.registry.get(fullname)
        if patch is None:
            return None
        found = importlib.machinery.PathFinder.find_spec(fullname, path)
        if found is None or not found.origin or not found.has_location:
            # Fail closed: loading the unpatched module would be a half-patched server.
            raise PatchError(f"cannot find the source of {fullname} ({patch.relpath}) to patch")
        source = apply(patch, Path(found.origin).read_bytes().decode("utf-8"))
        spec = importlib.util.spec_from_file_location(
            fullname,
            found.origin,
            loader=OverlayLoader(patch, found.origin, source),
            submodule_search_locations=found.submodule_search_locations,
        )
        self.loaded.append(fullname)
        return spec


def _active() -> OverlayFinder | None:
    """The finder on ``sys.meta_path``, if any: the import system is where it lives (a module
    variable beside it could disagree with it, and would be one more piece of process state)."""
    return next((f for f in sys.meta_path if isinstance(f, OverlayFinder)), None)


def install(registry: Mapping[str, FilePatch] | None = None) -> OverlayFinder:
    """Verify every patch, then put the finder first on ``sys.meta_path`` (idempotent).

    Raises PatchError, with nothing installed, when an edit does not match or when a module
    it patches was already imported (that copy would stay unpatched).
    """
    from server_patch.overlay.verify import verify_all

    finder = _active()
    if finder is not None:
        if registry is not None and dict(registry) != finder.registry:
            raise PatchError("the overlay is already installed with a different set of patches")
        return finder
    if registry is None:
        from server_patch.overlay.patches import load_topics

        registry = load_topics()
    verify_all(registry)
    early = sorted(name for name in registry if name in sys.modules)
    if early:
        raise PatchError(
            "install the overlay before importing mlx-vlm: already imported unpatched: "
            + ", ".join(early)
        )
    finder = OverlayFinder(registry)
    sys.meta_path.insert(0, finder)
    return finder


def installed() -> bool:
    """Whether the overlay's finder is active in this process."""
    return _active() is not None


def uninstall() -> None:
    """Remove the finder (modules already loaded stay patched); for tests and tools."""
    while (finder := _active()) is not None:
        sys.meta_path.remove(finder)
