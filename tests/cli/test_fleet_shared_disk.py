"""``fleet up`` gives its servers one shared disk tier by default (issue 38), and the operator's choice wins."""

from __future__ import annotations

import stat
from pathlib import Path

from apcctl.commands.fleet import plan
from apcctl.core.fleet_state import FleetState


def _specs(model: Path, *env_pairs: str):
    _, specs = plan("shared", 2, str(model), 31000, None, None, [], (), None, env_pairs)
    return specs


def test_each_server_writes_its_own_subdirectory_of_the_fleets_shared_one(cli_env: Path, tmp_path: Path) -> None:
    specs = _specs(tmp_path)
    shared = FleetState("shared").directory / "shared-disk"
    assert {n: (s.env["APC_SHARED_DISK_PATH"], s.env["APC_LINEAGE_DISK_PATH"]) for n, s in specs.items()} == {
        "shared-1": (str(shared), str(shared / "shared-1")),
        "shared-2": (str(shared), str(shared / "shared-2")),
    }
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700  # peers must be this user's own


def test_an_operators_shared_path_or_opt_out_wins(cli_env: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "team"
    specs = _specs(tmp_path, f"APC_SHARED_DISK_PATH={elsewhere}")
    assert specs["shared-1"].env["APC_LINEAGE_DISK_PATH"] == str(elsewhere / "shared-1")
    off = _specs(tmp_path, "APC_SHARED_DISK_PATH=")
    assert off["shared-1"].env["APC_SHARED_DISK_PATH"] == ""
    assert off["shared-1"].env["APC_LINEAGE_DISK_PATH"].endswith("shared-1/lineage-disk")
    own = _specs(tmp_path, f"APC_LINEAGE_DISK_PATH={tmp_path / 'mine'}")
    assert own["shared-1"].env["APC_LINEAGE_DISK_PATH"] == str(tmp_path / "mine")
