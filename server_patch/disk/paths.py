"""Where the disk tier lives and whether it is on, without importing MLX or mlx-vlm.

``server_patch.launch`` takes the directory lock before the overlay is installed, and
``apcctl check`` runs without a model, so both need these answers from a light module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from server_patch import settings


def default_disk_root(env: Mapping[str, str] | None = None) -> Path:
    """``APC_LINEAGE_DISK_PATH``, else the per-user cache directory."""
    configured = settings.value("APC_LINEAGE_DISK_PATH", env)
    if configured is not None:
        return Path(configured).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("apcctl")) / "lineage"


def disk_enabled(env: Mapping[str, str] | None = None) -> bool:
    return settings.value("APC_LINEAGE_DISK", env)
