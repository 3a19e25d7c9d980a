"""A server started with a disk path never touches the user's home cache.

mlx-vlm 0.7.10 creates its own disk tier's directory, ``~/.cache/mlx-vlm/apc/<namespace>``, at
start (``server_patch.disk.stock_home``). The server runs with HOME and the XDG directories in
a fresh tmp dir, stock's disk tier on at its default path, and the lineage's disk tier at a
given path: after a request and a shutdown, nothing is under HOME, and stock's directory is
under the given path.
"""

from __future__ import annotations

from pathlib import Path

from tests.server_harness import PatchedServer
from server_patch.disk.stock_home import STOCK_SUBDIR, stock_disk_env

HOME_VARIABLES = ("XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME")


def everything_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_server_with_a_disk_path_leaves_home_untouched(tiny_model_dir, tmp_path):
    home, disk = tmp_path / "home", tmp_path / "disk"
    home.mkdir()
    env = {"HOME": str(home), "APC_DISK_ENABLED": "1", "APC_DISK_PATH": None, "MLX_VLM_CACHE_HOME": None,
           "APC_LINEAGE_DISK_PATH": str(disk), **{key: None for key in HOME_VARIABLES}}
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "logs") as server:
        reply = server.chat([{"role": "user", "content": "Hello there"}], max_tokens=3)
        assert reply["choices"][0]["message"]["content"] is not None
    assert everything_under(home) == []
    assert (disk / STOCK_SUBDIR).is_dir()  # stock's own tier lives under the given path


def test_stock_disk_env_leaves_explicit_settings_alone(tmp_path):
    given = {"APC_LINEAGE_DISK_PATH": str(tmp_path)}
    assert stock_disk_env(given) == {"APC_DISK_PATH": str(tmp_path / STOCK_SUBDIR)}
    assert stock_disk_env({**given, "APC_DISK_PATH": ""}) == {}  # stock's tier off, as asked
    assert stock_disk_env({**given, "MLX_VLM_CACHE_HOME": str(tmp_path / "m")}) == {}
    assert stock_disk_env({}) == {}  # no --disk-path: the lineage's own default is per-user too
