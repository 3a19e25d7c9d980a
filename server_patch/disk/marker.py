"""Which directories are lineage disk tiers, so that ``apcctl check --fix`` only ever removes our files.

A tier is recognised by its marker file ``.apc-lineage-tier``, written when the server's disk
store first opens the tier (``DiskStore``). A tier written by an earlier version, which had no
marker, is recognised by its layout instead (``legacy_layout``); the next server start marks it.

The legacy rule, kept strict on purpose (a models directory must never match): the directory
holds the ``.lock`` file every earlier server created at start, at least one per-fingerprint
subdirectory, and nothing visible but per-fingerprint subdirectories (16 hex digits, with a
``-<codec>`` suffix for a quantized KV layout) that hold nothing visible but ``*.safetensors``
files, and stock mlx-vlm's own tier (``stock_home.STOCK_SUBDIR``). A model directory has ``config.json`` and its weights at the top: never a tier.

Within a tier, only files directly inside its per-fingerprint subdirectories are ours;
everything else is foreign.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from server_patch.disk.integrity import SUFFIX
from server_patch.disk.lock import LOCK_NAME
from server_patch.disk.stock_home import STOCK_SUBDIR
from server_patch.private_files import create_private, fsync_dir

MARKER_NAME = ".apc-lineage-tier"
MARKER_TEXT = b"apcctl lineage disk tier: files in its per-fingerprint subdirectories are the server's cache\n"
_FINGERPRINT_DIR = re.compile(r"^[0-9a-f]{16}(-[a-z0-9]+)?$")


def is_fingerprint_dir(path: Path) -> bool:
    return bool(_FINGERPRINT_DIR.match(path.name))


def mark(tier: Path) -> None:
    """Write ``tier``'s marker (0600) unless it has one; never raises for a read-only directory."""
    path = tier / MARKER_NAME
    if path.exists():
        return
    try:
        fd = create_private(path)
    except FileExistsError:
        return
    except OSError:  # a read-only mount: the legacy layout rule still recognises it
        return
    try:
        os.write(fd, MARKER_TEXT)
    finally:
        os.close(fd)
    fsync_dir(tier)


def _visible(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if not p.name.startswith(".")]


def legacy_layout(tier: Path) -> bool:
    """A tier written before the marker existed (see the module's docstring for the rule)."""
    try:
        if not (tier / LOCK_NAME).is_file():
            return False
        entries = _visible(tier)
        if not any(is_fingerprint_dir(sub) for sub in entries):
            return False
        for sub in entries:
            if sub.name == STOCK_SUBDIR and sub.is_dir():
                continue
            if sub.is_symlink() or not sub.is_dir() or not is_fingerprint_dir(sub):
                return False
            if any(p.is_dir() or not p.name.endswith(SUFFIX) for p in _visible(sub)):
                return False
    except OSError:
        return False
    return True


def is_tier(tier: Path) -> bool:
    """``tier`` carries our marker, or has the layout of an earlier version's tier."""
    return (tier / MARKER_NAME).is_file() or legacy_layout(tier)


def tier_of(root: Path) -> Path:
    """The tier a ``--disk-path`` names: itself, or the tier above a per-fingerprint subdirectory."""
    if is_fingerprint_dir(root) and not is_tier(root) and is_tier(root.parent):
        return root.parent
    return root


def ours(path: Path, tier: Path) -> bool:
    """``path`` sits directly in one of ``tier``'s per-fingerprint subdirectories."""
    return path.parent.parent == tier and is_fingerprint_dir(path.parent)


__all__ = ["MARKER_NAME", "is_fingerprint_dir", "is_tier", "legacy_layout", "mark", "ours", "tier_of"]
