"""Where the patched server keeps state: ``APC_STATE_DIR``, else the per-user state dir."""

from __future__ import annotations

from pathlib import Path


def state_dir() -> Path:
    """Admin token, journal and other per-server state (not the disk tier's cache files)."""
    from server_patch import settings

    configured = settings.value("APC_STATE_DIR")
    if configured:
        return Path(configured).expanduser()
    from platformdirs import user_state_dir

    return Path(user_state_dir("apcctl"))
