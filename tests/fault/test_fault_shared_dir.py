"""``--disk-path`` on a directory others share (a 1777 ``/tmp``-like one), on a real server.

Before the fix the server chmodded the given directory to 0700 (a shared ``/tmp`` lost its
sticky, world-writable mode). Now the server never changes the mode of a directory it did not
create: the tier lives in a private subdirectory ``apcctl-<uid>`` (0700), and the launcher warns.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.server_harness import PatchedServer, text, wait_for
from server_patch.disk_paths import default_disk_root, prepare_root, private_subdir, shared_warning


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _shared(tmp_path: Path, mode: int = 0o1777) -> Path:
    shared = tmp_path / "shared"
    shared.mkdir(parents=True)
    os.chmod(shared, mode)  # not through mkdir: the umask would mask it
    return shared


@pytest.mark.server
def test_a_world_writable_disk_path_keeps_its_mode_and_gets_a_private_subdirectory(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    shared = _shared(tmp_path)
    journal = _shared(tmp_path / "j")  # a shared journal directory keeps its mode too; its files are 0600
    server = PatchedServer(tiny_model_dir, env={"APC_LINEAGE_DISK": "1", "APC_LINEAGE_DISK_PATH": str(shared),
                                                "APC_JOURNAL_DIR": str(journal)},
                           log_dir=tmp_path / "log")
    try:
        server.start()
        server.chat([{"role": "system", "content": text(300, 501)}, {"role": "user", "content": "hi"}],
                    max_tokens=2)
        own = private_subdir(shared)
        wait_for(lambda: any(own.rglob("*.safetensors")), "the anchor's disk write", server)
        status, body = server.admin("GET", "/status")
        assert status == 200 and Path(body["lineage"]["disk_path"]).parent == own, body["lineage"]
    finally:
        server.stop()
    assert _mode(shared) == 0o1777 and _mode(journal) == 0o1777
    journal_files = list(journal.iterdir())
    assert journal_files and all(_mode(p) == 0o600 for p in journal_files)
    assert _mode(own) == 0o700 and (own / ".lock").exists()
    assert not [p for p in shared.iterdir() if p != own]  # nothing of ours outside the subdirectory
    assert "group- or world-writable (mode 1777)" in server.log_text(), server.log_tail()


def test_a_group_writable_path_is_shared_and_a_private_one_is_used_as_it_is(tmp_path: Path) -> None:
    group = _shared(tmp_path, 0o2775)
    env = {"APC_LINEAGE_DISK_PATH": str(group)}
    assert default_disk_root(env) == private_subdir(group) and "mode 2775" in (shared_warning(env) or "")
    private = tmp_path / "mine"
    private.mkdir(mode=0o755)
    os.chmod(private, 0o755)
    env = {"APC_LINEAGE_DISK_PATH": str(private)}
    assert default_disk_root(env) == private and shared_warning(env) is None
    prepare_root(private)
    assert _mode(private) == 0o755  # not ours to tighten: the files inside are 0600 in 0700 dirs


def test_a_subdirectory_that_is_not_this_users_own_is_refused(tmp_path: Path) -> None:
    shared = _shared(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    private_subdir(shared).symlink_to(elsewhere)  # someone else's trap: never write through it
    with pytest.raises(PermissionError, match="not a directory of this user's"):
        prepare_root(default_disk_root({"APC_LINEAGE_DISK_PATH": str(shared)}))
