"""A fleet's servers share one disk tier by default (issue 38).

Each managed server writes its own subdirectory of ``<fleet dir>/shared-disk`` (its
``APC_LINEAGE_DISK_PATH``, under its own lock) and reads the others' (``APC_SHARED_DISK_PATH``,
``server_patch.disk.peers``), so a session smg sends to another server, during a roll or after
one is removed, restores from the file its last server wrote. What the operator chose wins: an
``APC_SHARED_DISK_PATH`` given with ``-e`` or in the config (blank: no sharing), and a disk path
other than the default one.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from apcctl.core.fleet_state import FleetState
from apcctl.core.manage import ServerSpec, servers_root
from server_patch.private_files import private_dir

SHARED_SUBDIR = "shared-disk"
SHARED_ENV, DISK_ENV = "APC_SHARED_DISK_PATH", "APC_LINEAGE_DISK_PATH"


def share_for(fleet_name: str, specs: dict[str, ServerSpec]) -> dict[str, ServerSpec]:
    """``share`` in the fleet's own directory (a bad fleet name is refused later, by ``fleet up``)."""
    try:
        return share(FleetState(fleet_name).directory, specs)
    except ValueError:
        return specs


def share(fleet_dir: Path, specs: dict[str, ServerSpec]) -> dict[str, ServerSpec]:
    """``specs`` with the fleet's shared directory where the operator did not choose otherwise."""
    shared = fleet_dir / SHARED_SUBDIR
    out = {}
    for name, spec in specs.items():
        env = dict(spec.env)
        if SHARED_ENV not in env:
            env[SHARED_ENV] = str(shared)
        if env.get(DISK_ENV) == str(servers_root() / name / "lineage-disk") and env[SHARED_ENV]:
            env[DISK_ENV] = str(Path(env[SHARED_ENV]) / name)
        out[name] = spec if env == spec.env else replace(spec, env=env)
    if any(s.env.get(SHARED_ENV) == str(shared) for s in out.values()):
        private_dir(shared)  # 0700: its peers must be this user's own (``peers.refusal``)
    return out
