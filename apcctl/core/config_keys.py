"""Which ``config.toml`` server-table keys become which server environment variables.

In the core because the core's restart planning (``respec.override_notes``) names them too, and
the core imports nothing else of ``apcctl``; ``apcctl.config`` reads the tables with them.
"""

from __future__ import annotations

# Budget keys of a [servers.NAME] table -> the server's environment at ``apcctl serve``.
BUDGET_KEYS = {"ram_budget": "APC_LINEAGE_RAM_BUDGET_BYTES", "disk_budget": "APC_LINEAGE_DISK_MAX_BYTES",
               "anchor_budget": "APC_LINEAGE_ANCHOR_MAX_BYTES", "max_anchors": "APC_LINEAGE_ANCHOR_MAX_ENTRIES"}
# Serving keys (a string or a list of strings) -> the server's environment at ``apcctl serve``.
SERVING_KEYS = {"served_model_name": "APC_SERVED_MODEL_NAME", "allowed_origins": "APC_ALLOWED_ORIGINS",
                "allowed_hosts": "APC_ALLOWED_HOSTS"}
# Directory keys (a path; ``~`` expanded, "" turns the feature off) -> the server's environment.
PATH_KEYS = {"shared_disk_path": "APC_SHARED_DISK_PATH"}
