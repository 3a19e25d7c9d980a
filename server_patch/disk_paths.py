"""Where the disk tier lives, whether it is on and how big its volume is, without importing MLX
or mlx-vlm.

``server_patch.launch`` takes the directory lock before the overlay is installed, and
``apcctl check`` runs without a model, so both need these answers from a light module; the
lineage config sizes its default disk cap from the volume. It imports only the leaves, ``settings`` and ``private_files`` (it was
``disk.paths`` until issue 35: the lineage config reading it made ``lineage`` and ``disk``, which
stores the lineage's entries, import each other).

The server never changes the mode of a directory it did not create. A configured directory
that others may write to (group- or world-writable: ``/tmp``, a team share) is left as it is,
and the tier lives in a private subdirectory ``apcctl-<uid>`` of it (0700, and refused unless it
is a real directory of this user's: another user could have made it first). The launcher warns.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Mapping

from server_patch import settings

SHARED_BITS = stat.S_IWGRP | stat.S_IWOTH


def configured_disk_path(env: Mapping[str, str] | None = None) -> Path:
    """``APC_LINEAGE_DISK_PATH``, else the per-user cache directory (as given: see
    ``default_disk_root`` for where the files go)."""
    configured = settings.value("APC_LINEAGE_DISK_PATH", env)
    if configured is not None:
        return Path(configured).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("apcctl")) / "lineage"


def is_shared(path: Path) -> bool:
    """An existing directory that others may write to."""
    try:
        return bool(path.stat().st_mode & SHARED_BITS)
    except OSError:
        return False


def private_subdir(path: Path) -> Path:
    return path / f"apcctl-{os.getuid()}"


def default_disk_root(env: Mapping[str, str] | None = None) -> Path:
    """The configured directory, or its private subdirectory when others may write to it."""
    given = configured_disk_path(env)
    return private_subdir(given) if is_shared(given) else given


def prepare_root(root: Path) -> Path:
    """Create ``root`` (``default_disk_root``'s answer) without changing the mode of anything
    the server did not create: a private subdirectory of a shared one must be this user's own."""
    from server_patch.private_files import own_private_dir, private_dir

    if root.parent != root and is_shared(root.parent) and root == private_subdir(root.parent):
        return own_private_dir(root)
    return private_dir(root, tighten=False)


def shared_warning(env: Mapping[str, str] | None = None) -> str | None:
    """What the launcher says when the configured directory is group- or world-writable."""
    given = configured_disk_path(env)
    if not is_shared(given):
        return None
    mode = stat.S_IMODE(given.stat().st_mode)
    return (f"lineage disk directory {given} is group- or world-writable (mode {mode:04o}); its mode is left "
            f"as it is and the disk tier uses the private subdirectory {private_subdir(given)}")


def disk_enabled(env: Mapping[str, str] | None = None) -> bool:
    return settings.value("APC_LINEAGE_DISK", env)


def volume_usage(root: Path) -> tuple[int, int] | None:
    """``(total, free)`` bytes of the volume ``root`` is, or will be, on (the tier creates its
    directory on first use, so the nearest existing parent is read); None when unreadable."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        total, _, free = shutil.disk_usage(probe)
    except (OSError, ValueError):
        return None
    return total, free
