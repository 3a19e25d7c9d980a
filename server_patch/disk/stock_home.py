"""Where mlx-vlm's own disk tier goes when the lineage's is given a directory.

mlx-vlm 0.7.10 builds its APC manager with a disk tier at ``APC_DISK_PATH``, by default
``~/.cache/mlx-vlm/apc/<namespace>`` (``apc.default_disk_path``), whatever the model: it creates
that directory at start even when the lineage cache serves the model and stock never writes
there. A server started with ``--disk-path`` (``APC_LINEAGE_DISK_PATH``) must not touch the
user's home cache, so the launcher points stock's tier at a subdirectory of the lineage's (the
block-mode models stock's cache serves keep their disk tier, under the directory given). An
explicit ``APC_DISK_PATH`` (empty: off) or ``MLX_VLM_CACHE_HOME`` is left as it is.
"""

from __future__ import annotations

from typing import Mapping

from server_patch import settings
from server_patch.disk_paths import default_disk_root

STOCK_SUBDIR = "mlx-vlm-apc"  # fsck and the store read */*.safetensors: stock's shards sit deeper


def stock_disk_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``env`` so that stock's disk tier stays out of HOME."""
    if "APC_DISK_PATH" in env or env.get("MLX_VLM_CACHE_HOME"):
        return {}
    if settings.value("APC_LINEAGE_DISK_PATH", env) is None:
        return {}  # the lineage's own default is the per-user cache directory: stock's stays too
    return {"APC_DISK_PATH": str(default_disk_root(env) / STOCK_SUBDIR)}
