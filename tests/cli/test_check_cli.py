"""``apcctl check``: offline verification of lineage disk files, like ``fsck``.

Real files written by the real ``DiskStore`` (the in-process tiny model), damaged the way disks
damage them, checked through the real click command.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from apcctl.cli import main
from server_patch.disk import integrity
from server_patch.disk.lock import DiskLock
from tests.disk.test_disk_store import rewrite_header, written

FINGERPRINT = "0123456789abcdef" + "0" * 48


@pytest.fixture
def disk(tmp_path, model, layout, monkeypatch) -> Path:
    """A lineage root like a server's: <root>/<fingerprint[:16]>/ with one entry file."""
    monkeypatch.delenv("APC_LINEAGE_DISK_PATH", raising=False)
    root = tmp_path / "lineage"
    written(root / FINGERPRINT[:16], model, layout, seed=81, fingerprint=FINGERPRINT)
    return root


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["check", *args])
    return result.exit_code, result.output


def only_file(root: Path) -> Path:
    (path,) = list(root.rglob("*.safetensors"))
    return path


def flip_data_byte(path: Path) -> None:
    header = integrity.read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_start + header.tensors[0].nbytes // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_clean_directory_exits_0(disk):
    code, out = run("--disk-path", str(disk))
    assert code == 0, out
    assert "1 files checked, 0 damaged" in out


def test_a_shared_directory_is_checked_where_the_server_writes(tmp_path, model, layout, monkeypatch):
    import os

    from server_patch.disk_paths import private_subdir

    monkeypatch.delenv("APC_LINEAGE_DISK_PATH", raising=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # a server given this directory writes into its apcctl-<uid> subdirectory
    written(private_subdir(shared) / FINGERPRINT[:16], model, layout, seed=82, fingerprint=FINGERPRINT)
    code, out = run("--disk-path", str(shared))
    assert code == 0, out
    assert f"{private_subdir(shared)}: 1 files checked, 0 damaged" in out


def test_damage_is_listed_then_fixed(disk):
    path = only_file(disk)
    flip_data_byte(path)
    code, out = run("--disk-path", str(disk))
    assert code == 1 and f"damaged: {path}: hash: tensor data hash does not match" in out, out
    assert path.exists()  # without --fix nothing is touched

    code, out = run("--disk-path", str(disk), "--fix")
    assert code == 1 and f"removed: {path}" in out, out
    assert not path.exists()
    assert run("--disk-path", str(disk))[0] == 0


def test_json_output_parses_and_names_the_reason(disk):
    rewrite_header(only_file(disk), lambda h: h["__metadata__"].update(identity=json.dumps({"mlx": "0.0.1"})))
    code, out = run("--disk-path", str(disk), "--json")
    report = json.loads(out)
    assert code == 1 and report["clean"] is False and report["checked"] == 1
    (finding,) = report["damaged"]
    assert finding["reason"] == "fingerprint" and "mlx" in finding["detail"] and finding["removed"] is False


def test_a_file_in_another_models_directory_is_damaged(disk):
    path = only_file(disk)
    moved = disk / "fedcba9876543210" / path.name
    moved.parent.mkdir()
    path.rename(moved)
    code, out = run("--disk-path", str(disk))
    assert code == 1 and "fingerprint does not match its directory" in out, out


def test_a_leftover_temp_file_is_damaged_but_a_live_servers_is_not(disk):
    tmp = disk / FINGERPRINT[:16] / ".abc.1.2.tmp.safetensors"
    tmp.write_bytes(b"partial")
    code, out = run("--disk-path", str(disk))
    assert code == 1 and "temp: left by an interrupted write" in out
    with DiskLock(disk):  # a running server holds the directory: its temp file is in flight
        code, out = run("--disk-path", str(disk), "--json")
        assert code == 0 and json.loads(out)["in_flight"] == [str(tmp)], out


def test_fix_is_refused_while_a_server_holds_the_directory(disk):
    flip_data_byte(only_file(disk))
    with DiskLock(disk):
        code, out = run("--disk-path", str(disk), "--fix")
        assert code == 2 and f"{disk} is in use by process" in out, out
        assert only_file(disk).exists()
        # A per-fingerprint subdirectory is guarded by the root's lock too.
        code, out = run("--disk-path", str(disk / FINGERPRINT[:16]), "--fix")
        assert code == 2 and "in use by process" in out, out


def test_default_path_is_the_servers_and_usage_errors_exit_2(disk, monkeypatch, tmp_path):
    flip_data_byte(only_file(disk))
    monkeypatch.setenv("APC_LINEAGE_DISK_PATH", str(disk))
    assert run()[0] == 1
    assert run("--disk-path", str(tmp_path / "missing"))[0] == 2
    assert run("--bogus")[0] == 2


def test_check_does_not_import_the_server():
    code = ("import sys; from click.testing import CliRunner; from apcctl.cli import main; "
            "r = CliRunner().invoke(main, ['check', '--disk-path', sys.argv[1]]); "
            "assert r.exit_code == 0, r.output; "
            "bad = [m for m in sys.modules if m.startswith(('mlx_vlm', 'mlx.core', 'fastapi', 'uvicorn'))]; "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_managed_servers_disk_path_is_its_default(disk, monkeypatch, tmp_path):
    from apcctl.core.manage import ManagedServer, build_spec

    monkeypatch.setenv("APC_STATE_DIR", str(tmp_path / "state"))
    for key in ("APCCTL_SERVER", "APCCTL_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    ManagedServer("main").save(build_spec("main", model="m", port=8181, disk_path=disk))
    flip_data_byte(only_file(disk))
    code, out = run("--server", "main")
    assert code == 1 and out.startswith(f"{disk.resolve()}: 1 files checked, 1 damaged"), out


def test_the_environment_beats_a_managed_servers_record(disk, monkeypatch, tmp_path, model, layout, private_home):
    """A record of server 'default' in the user's state dir (what the developer's own server
    leaves) names a clean disk; APC_LINEAGE_DISK_PATH names the damaged one and wins, as the
    documented precedence (flags, environment, then state files) says."""
    from apcctl.core.manage import ManagedServer, build_spec
    from server_patch.paths import state_dir

    clean = tmp_path / "clean"
    written(clean / FINGERPRINT[:16], model, layout, seed=82, fingerprint=FINGERPRINT)
    for key in ("APCCTL_SERVER", "APCCTL_CONFIG", "APC_STATE_DIR"):
        monkeypatch.delenv(key, raising=False)
    assert state_dir().is_relative_to(private_home)  # the tests' private HOME, never the real one
    ManagedServer("default").save(build_spec("default", model="m", port=8182, disk_path=clean))
    try:
        assert run()[0] == 0  # the record's clean disk
        flip_data_byte(only_file(disk))
        monkeypatch.setenv("APC_LINEAGE_DISK_PATH", str(disk))
        code, out = run()
        assert code == 1 and out.startswith(f"{disk}: 1 files checked, 1 damaged"), out
    finally:
        import shutil

        shutil.rmtree(ManagedServer("default").directory)
