"""A flush that cannot write, through the real CLI against a real managed server.

The server runs with the free-space floor above the volume's free space
(``APC_LINEAGE_DISK_MIN_FREE`` halfway between the free fraction and 1), so no disk write is ever attempted. Before the fix
``POST /admin/flush`` answered ``complete: true``, ``apcctl flush`` printed "3 entries written"
and exited 0 with an empty directory, and ``apcctl restart`` then stopped the server and lost
its RAM tier. Now the flush reports what reached the disk (nothing) and exits 1, and a restart
stops nothing unless ``--force``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from apcctl.core.client import AdminClient
from apcctl.core.hosts import free_port
from tests.cli.test_cli_server import chat, run, run_json

pytestmark = pytest.mark.server

NAME = "fullfloor"
SYSTEM = "You are the full disk assistant. Answer in one word, and cite the file and the line. " * 3


@pytest.fixture(scope="module")
def full(cli_env: Path, tiny_model_dir: Path) -> dict[str, Any]:
    disk = cli_env / "disk"
    total, _, free = shutil.disk_usage(cli_env)
    floor = (free / total + 1) / 2  # above the free space, below 100 %
    info = run_json("serve", "--name", NAME, "--model", str(tiny_model_dir), "--port", str(free_port()),
                    "-e", "APC_LINEAGE_DISK=1", "-e", f"APC_LINEAGE_DISK_PATH={disk}",
                    "-e", f"APC_LINEAGE_DISK_MIN_FREE={floor:.6f}",
                    # One anchor fills the cap: the restart skips its probe anchor (which could never
                    # come back from this disk) and reaches the flush.
                    "-e", "APC_LINEAGE_ANCHOR_MAX_ENTRIES=1")
    token = (Path(info["state_dir"]) / "admin-token").read_text().strip()
    client = AdminClient(info["url"], token)
    for question in ("Where is the cache?", "Where is the lock?"):
        chat(client, SYSTEM, question)
    return {"client": client, "disk": disk}


def _files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.safetensors"))


def _entry_ids(client: AdminClient) -> set[str]:
    return {e["id"] for e in client.entries()}


def test_a_flush_that_writes_nothing_says_so_and_exits_1(full: dict[str, Any]) -> None:
    shown = run("flush", "--server", NAME, code=1)
    assert "0 entries written" in shown.output and "not:" in shown.output and "floor" in shown.output, shown.output
    answer = json.loads(run("flush", "--server", NAME, "--json", code=1).stdout)
    assert answer["complete"] is False and answer["written"] == 0 and answer["failed"] >= 1, answer
    assert len(answer["unwritten"]) == answer["failed"] and "APC_LINEAGE_DISK_MIN_FREE" in answer["reason"], answer
    assert _files(full["disk"]) == []


def test_a_restart_after_a_failed_flush_stops_nothing(full: dict[str, Any]) -> None:
    client: AdminClient = full["client"]
    pid, entries = client.status()["server"]["pid"], _entry_ids(client)
    shown = run("restart", "--server", NAME, code=1)
    assert "nothing stopped" in shown.output and "--force" in shown.output, shown.output
    status = client.status()
    assert status["server"]["pid"] == pid and status["idle"]["draining"] is False
    assert entries <= _entry_ids(client)  # the RAM tier is still there
    assert chat(client, SYSTEM, "Still there?")["restore_kind"] in ("anchor", "entry")


def test_a_forced_restart_stops_it_anyway_and_says_what_was_lost(full: dict[str, Any]) -> None:
    client: AdminClient = full["client"]
    pid = client.status()["server"]["pid"]
    shown = run("restart", "--server", NAME, "--force")
    assert "--force: flush wrote 0 entries" in shown.output and "stopping anyway" in shown.output, shown.output
    status = client.status()
    assert status["server"]["pid"] != pid and status["lineage"] is None  # a new process: the RAM tier is gone
