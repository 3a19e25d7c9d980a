"""The shared disk tier's place in a server's spec (issue 38): a fleet shares one by default,
``apcctl serve --shared-disk-path`` (or ``shared_disk_path`` in its config table) joins one.

Each server writes its own subdirectory of the shared directory (its ``APC_LINEAGE_DISK_PATH``,
under its own lock) and reads the others' (``APC_SHARED_DISK_PATH``, ``server_patch.disk.peers``),
so a session smg sends to another server, during a roll or after one is removed, restores from
the file its last server wrote. What the operator chose wins: an ``APC_SHARED_DISK_PATH`` given
with ``-e`` or in the config (blank: no sharing), and a disk path other than the default one.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from apcctl.core.fleet_state import FleetState
from apcctl.core.manage import ServerSpec, servers_root
from server_patch.private_files import private_dir

SHARED_SUBDIR = "shared-disk"
SHARED_ENV, DISK_ENV = "APC_SHARED_DISK_PATH", "APC_LINEAGE_DISK_PATH"


class SharedDiskError(ValueError):
    """The shared directory asked for cannot be used; the message says why (a usage error)."""


def checked(path: Path | str) -> Path:
    """``path`` made absolute, created 0700 when missing; an existing one must be a directory of
    this user's that nobody else may write to (the rule each server applies to its peers'
    directories: anyone who can write there could plant entries or rename a peer away)."""
    from server_patch.disk.peers import refusal  # (the disk store's imports: only when a path is given)

    path = Path(path).expanduser().resolve()
    if not os.path.lexists(path):
        try:
            private_dir(path)
        except OSError as exc:
            raise SharedDiskError(f"shared disk path {path}: cannot create it: {exc.strerror or exc}") from None
        return path
    why = refusal(path)
    if why is not None:
        raise SharedDiskError(f"shared disk path {path}: {why}; give a directory of your own that only you "
                              f"can write to (e.g. chmod 700 it)")
    return path


def joined(spec: ServerSpec, previous_shared: str | None = None) -> ServerSpec:
    """``spec`` writing its own subdirectory of its shared directory (``APC_SHARED_DISK_PATH``,
    unless blank) when its disk path is the default one, or ``previous_shared/NAME`` (the
    subdirectory of the shared directory of its last start): its peers read what it writes."""
    shared = spec.env.get(SHARED_ENV)
    if not shared:
        return spec
    defaults = {str(servers_root() / spec.name / "lineage-disk")}
    if previous_shared:
        defaults.add(str(Path(previous_shared) / spec.name))
    if spec.env.get(DISK_ENV) not in defaults or spec.env[DISK_ENV] == str(Path(shared) / spec.name):
        return spec
    return replace(spec, env={**spec.env, DISK_ENV: str(Path(shared) / spec.name)})


def share_for(fleet_name: str, specs: dict[str, ServerSpec], shared: Path | None = None) -> dict[str, ServerSpec]:
    """``share`` in the fleet's own directory, or in ``shared`` (``fleet up --shared-disk-path``:
    it wins over each server's own choice); a bad fleet name is refused later, by ``fleet up``."""
    if shared is not None:
        return share(shared, specs, override=True)
    try:
        return share(FleetState(fleet_name).directory / SHARED_SUBDIR, specs)
    except ValueError:
        return specs


def share(shared: Path, specs: dict[str, ServerSpec], *, override: bool = False) -> dict[str, ServerSpec]:
    """``specs`` with ``shared`` as the shared directory where the operator did not choose
    otherwise (``override``: everywhere), each server in its own subdirectory of it."""
    out = {}
    for name, spec in specs.items():
        before = spec.env.get(SHARED_ENV)
        if override or before is None:
            spec = replace(spec, env={**spec.env, SHARED_ENV: str(shared)})
        out[name] = joined(spec, before)
    if any(s.env.get(SHARED_ENV) == str(shared) for s in out.values()):
        private_dir(shared)  # 0700: its peers must be this user's own (``peers.refusal``)
    return out
