"""Where the shared disk tier comes from (issue 38): ``fleet up`` gives its servers one by default,
``fleet up --shared-disk-path`` or the ``[fleet]`` table another; ``apcctl serve --shared-disk-path``
(or a server table's ``shared_disk_path``, below the shell's ``APC_SHARED_DISK_PATH``) joins one,
and a directory that is not the user's own, or that others may write to, is a usage error."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import click
import pytest

from apcctl.commands.common import ExitStatus
from apcctl.commands.fleet import plan
from apcctl.commands.serve import server_spec, shared_disk_env
from apcctl.core.client import AdminClient
from apcctl.core.fleet_state import FleetState
from apcctl.core.hosts import free_port
from apcctl.fleet.traffic import RecordingClient
from tests.cli.test_cli_server import run, run_json
from tests.server_harness import text

SHARED, DISK = "APC_SHARED_DISK_PATH", "APC_LINEAGE_DISK_PATH"


def _specs(model: Path, *env_pairs: str, shared: str | None = None, config: Path | None = None):
    _, specs = plan("shared", 2, str(model), 31000, None, None, [], (), config, env_pairs, shared)
    return specs


def _tier(spec) -> tuple[str, str]:
    return spec.env[SHARED], spec.env[DISK]


def test_each_server_writes_its_own_subdirectory_of_the_fleets_shared_one(cli_env: Path, tmp_path: Path) -> None:
    specs = _specs(tmp_path)
    shared = FleetState("shared").directory / "shared-disk"
    assert {n: _tier(s) for n, s in specs.items()} == {
        "shared-1": (str(shared), str(shared / "shared-1")),
        "shared-2": (str(shared), str(shared / "shared-2")),
    }
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700  # peers must be this user's own


def test_an_operators_shared_path_or_opt_out_wins(cli_env: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "team"
    specs = _specs(tmp_path, f"APC_SHARED_DISK_PATH={elsewhere}")
    assert specs["shared-1"].env[DISK] == str(elsewhere / "shared-1")
    off = _specs(tmp_path, "APC_SHARED_DISK_PATH=")
    assert off["shared-1"].env[SHARED] == ""
    assert off["shared-1"].env[DISK].endswith("shared-1/lineage-disk")
    own = _specs(tmp_path, f"APC_LINEAGE_DISK_PATH={tmp_path / 'mine'}")
    assert own["shared-1"].env[DISK] == str(tmp_path / "mine")


def test_fleet_up_shared_disk_path_beats_the_fleet_table_and_the_default(cli_env: Path, tmp_path: Path) -> None:
    flag, table = tmp_path / "flag", tmp_path / "table"
    config = tmp_path / "fleet.toml"
    config.write_text(f"[servers.a]\nmodel = 'm'\n\n[fleet]\nservers = ['a']\nshared_disk_path = '{table}'\n",
                      encoding="utf-8")
    # --servers with a [fleet] table in the file: the table's shared path applies, the flag beats it
    assert _tier(_specs(tmp_path, config=config)["shared-1"]) == (str(table), str(table / "shared-1"))
    # an -e of the server's own loses to the fleet's flag: the flag names the fleet's one tier
    chosen = _specs(tmp_path, f"APC_SHARED_DISK_PATH={tmp_path / 'e'}", shared=str(flag), config=config)
    assert {n: _tier(s) for n, s in chosen.items()} == {
        "shared-1": (str(flag), str(flag / "shared-1")), "shared-2": (str(flag), str(flag / "shared-2"))}
    assert stat.S_IMODE(flag.stat().st_mode) == 0o700  # created for it
    private = _specs(tmp_path, shared="", config=config)["shared-1"]
    assert private.env[SHARED] == "" and private.env[DISK].endswith("shared-1/lineage-disk")
    with pytest.raises(click.UsageError, match="group- or world-writable"):
        _specs(tmp_path, shared=str(_writable_by_others(tmp_path / "open")))


def _writable_by_others(path: Path) -> Path:
    path.mkdir()
    path.chmod(0o777)
    return path


def _not_mine(tmp_path: Path) -> Path:
    """A directory another user owns: one chowned away when we are root, else ``/``."""
    if os.getuid() != 0:
        return Path("/")
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 4242, 4242)
    return path


def test_serve_refuses_a_shared_path_that_is_not_a_private_directory_of_ours(cli_env: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad, why in ((a_file, "not a directory"), (_writable_by_others(tmp_path / "open"), "world-writable"),
                     (_not_mine(tmp_path), "owned by uid")):
        result = run("serve", "--name", "refused", "--model", str(tmp_path), "--port", str(free_port()),
                     "--shared-disk-path", str(bad), code=int(ExitStatus.USAGE))
        assert why in result.output and str(bad.resolve()) in result.output, result.output
        assert "Traceback" not in result.output
    config = tmp_path / "bad.toml"
    config.write_text("[servers.refused]\nmodel = 'm'\nshared_disk_path = 7\n", encoding="utf-8")
    result = run("serve", "--name", "refused", "--config", str(config), code=int(ExitStatus.USAGE))
    assert "shared_disk_path must be a string" in result.output


def test_serve_shared_path_precedence_flag_then_shell_then_config(cli_env: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f"[servers.s]\nmodel = '{tmp_path}'\nshared_disk_path = '{tmp_path / 'toml'}'\n",
                      encoding="utf-8")

    def tier(flag: str | None = None) -> tuple[str, str]:
        spec, _ = server_spec("s", None, 9100, None, None, tuple(shared_disk_env(flag)), config, ())
        return _tier(spec)

    assert tier() == (str(tmp_path / "toml"), str(tmp_path / "toml" / "s"))
    monkeypatch.setenv(SHARED, str(tmp_path / "shell"))
    assert tier() == (str(tmp_path / "shell"), str(tmp_path / "shell" / "s"))
    assert tier(str(tmp_path / "flag")) == (str(tmp_path / "flag"), str(tmp_path / "flag" / "s"))
    shared, disk = tier("")  # the flag's blank turns sharing off: the server's own tier
    assert shared == "" and disk.endswith("/s/lineage-disk")


@pytest.mark.server
def test_two_served_servers_share_a_tier_by_flag_and_by_config_key(cli_env: Path, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """``serve --shared-disk-path DIR`` and a config table's ``shared_disk_path = DIR``: each server
    writes DIR/NAME, and a conversation the first served continues on the second from its file."""
    shared = tmp_path / "tier"  # missing: created 0700
    a = run_json("serve", "--name", "sa", "--model", str(tiny_model_dir), "--port", str(free_port()),
                 "--shared-disk-path", str(shared))
    assert a["sizing"]["disk"]["path"].startswith(str(shared / "sa"))
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700
    config = tmp_path / "config.toml"
    config.write_text(f"[servers.sb]\nmodel = '{tiny_model_dir}'\nport = {free_port()}\n"
                      f"shared_disk_path = '{shared}'\n", encoding="utf-8")
    b = run_json("serve", "--name", "sb", "--config", str(config), "-e", "APC_SHARED_DISK_SCAN_MS=100")
    assert b["sizing"]["disk"]["path"].startswith(str(shared / "sb"))
    try:
        first = AdminClient(a["url"], _token(a))
        second = AdminClient(b["url"], _token(b))
        turn = [{"role": "system", "content": text(300, 51)}, {"role": "user", "content": text(120, 52)}]
        client = RecordingClient(a["url"], timeout=300.0)
        client.tenant = "shared-serve"
        answer = client.chat(turn, model=str(tiny_model_dir), max_tokens=4, temperature=0.0)
        first.flush()
        other = RecordingClient(b["url"], timeout=300.0)
        other.tenant = "another-tenant"  # b's first request loads the model (and its disk tier)
        cold = other.chat(turn, model=str(tiny_model_dir), max_tokens=4, temperature=0.0)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a namespace restores only its own
        _wait_for(lambda: second.status()["lineage"]["disk"]["peers"]["files"].get("sa", 0) > 0, second)
        assert second.status()["lineage"]["disk"]["peers"]["path"] == str(shared)
        nxt = turn + [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                      {"role": "user", "content": text(60, 53)}]
        client.base_url = b["url"]
        warm = client.chat(nxt, model=str(tiny_model_dir), max_tokens=4, temperature=0.0)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, warm  # b never saw it: a's file
        assert second.requests()[-1].restore_kind == "disk"
    finally:
        run("stop", "--server", "sa", "--grace", "10")
        run("stop", "--server", "sb", "--grace", "10")


def _token(info: dict) -> str:
    return (Path(info["state_dir"]) / "admin-token").read_text().strip()


def _wait_for(condition, server: AdminClient, timeout: float = 120.0) -> None:
    """Until ``condition()`` (the server's own state), within ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, server.status()["lineage"]["disk"]
        time.sleep(0.05)


def test_a_recorded_server_started_with_another_shared_path_moves_its_own_subdirectory(cli_env: Path,
                                                                                      tmp_path: Path) -> None:
    """``apcctl serve`` of a stopped server with a new ``--shared-disk-path``: its files go to the new
    directory's NAME subdirectory (peers read only there); a disk path of its own choosing stays."""
    from apcctl.commands.serve import with_shared_disk
    from apcctl.core.manage import build_spec

    old, new = tmp_path / "old", tmp_path / "new"
    before = with_shared_disk(build_spec("r", model=str(tmp_path), port=9200, env={SHARED: str(old)}))
    assert before.env[DISK] == str(old / "r")
    moved = with_shared_disk(build_spec("r", model=str(tmp_path), port=9200,
                                        env={SHARED: str(new), DISK: before.env[DISK]}), before)
    assert _tier(moved) == (str(new), str(new / "r"))
    own = with_shared_disk(build_spec("r", model=str(tmp_path), port=9200,
                                      env={SHARED: str(new), DISK: str(tmp_path / "mine")}), before)
    assert own.env[DISK] == str(tmp_path / "mine")
