"""mlx-vlm's own APC figures come from the lineage cache where it serves the model.

* apc.py: ``APCManager.stats_snapshot`` (``GET /metrics``' ``server.apc``, ``GET /v1/cache/stats``)
  hands its snapshot to the door (``stock_stats``) once its lock is released; behind a lineage
  cache the counters stock never sees are filled from it (``server_patch.admin.stock_stats``).

This module must not import mlx-vlm (topics load before the import hook).
"""

from __future__ import annotations

from server_patch.overlay.edits import Edit
from server_patch.overlay.pristine import patch_of

FILE_PATCHES = (
    patch_of(
        "mlx_vlm.apc",
        Edit(
            name="stock_stats.lineage_figures",
            old="            return snap\n\n    def reset_stats(self) -> None:\n",
            new=("            from server_patch.integration import hooks as _apc_door\n"
                 "        return _apc_door.stock_stats(self, snap)\n\n    def reset_stats(self) -> None:\n"),
        ),
    ),
)
