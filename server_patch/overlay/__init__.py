"""Exact-text edits to mlx-vlm 0.7.10, applied by an import hook; site-packages is untouched.

Per file: the sha256 of the pristine file and a list of edits that must each match exactly
once (``edits``). Topics under ``patches/`` contribute them; ``patches.load_topics()`` builds
the registry from the topics it lists, afresh on every call. ``install()`` verifies every edit
against the installed files first, then puts a finder first on ``sys.meta_path`` that loads
the patched modules from edited source (``hook``). ``unified_diff()`` shows the whole patch.

Usage: ``install()`` before anything imports ``mlx_vlm.server`` (``python -m
server_patch.launch`` does it); ``APC_LINEAGE=0`` in the launcher skips it entirely.
"""

from server_patch.overlay.diff import unified_diff
from server_patch.overlay.edits import Edit, FilePatch, PatchError, apply, register
from server_patch.overlay.hook import OverlayFinder, install, installed, uninstall
from server_patch.overlay.verify import installed_path, pristine_text, verify_all

__all__ = [
    "Edit",
    "FilePatch",
    "OverlayFinder",
    "PatchError",
    "apply",
    "install",
    "installed",
    "installed_path",
    "pristine_text",
    "register",
    "uninstall",
    "unified_diff",
    "verify_all",
]
