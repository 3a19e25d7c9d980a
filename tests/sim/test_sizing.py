"""Sizing before the first request: the budgets (from the config file per server), physical
memory and the disk volume's free space are known from the start, printed by ``serve``, shown by
``status`` and ``entries``, and what the machine cannot hold is a warning in both places."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import isolate_cli
from click.testing import CliRunner

from apcctl.cli import main
from apcctl.commands.common import ExitStatus
from apcctl.commands.serve import server_spec
from server_patch.admin.views import configured_budgets, sizing_warnings
from server_patch.lineage import LineageConfig

TiB = 1 << 40
# More than any machine has: both warnings fire wherever the test runs.
CONFIG = '''default = "sized"

[servers.sized]
ram_budget = "1T"
disk_budget = "65536T"
max_anchors = 3
anchor_budget = "2G"
'''


def apcctl(*args: str, code: int = 0) -> CliRunner:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == code, f"apcctl {' '.join(args)} -> {result.exit_code}\n{result.output}"
    return result


@pytest.fixture()
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    isolate_cli(monkeypatch, tmp_path)
    (tmp_path / "apcctl.toml").write_text(CONFIG)
    return tmp_path


def test_warnings_name_what_the_machine_lacks() -> None:
    config = LineageConfig(ram_budget_bytes=64 << 30, disk_max_bytes=TiB)
    assert sizing_warnings(config, ram_total=128 << 30, disk_enabled=True, disk_free=2 * TiB) == []
    ram, disk = sizing_warnings(config, ram_total=32 << 30, disk_enabled=True, disk_free=100 << 30)
    assert "RAM budget 64.0 GiB exceeds physical memory 32.0 GiB" in ram
    assert "disk cap 1.0 TiB exceeds the free space" in disk and "100.0 GiB free" in disk
    # The cache's own files count as room it has: a full cache on a full disk is not a warning.
    assert sizing_warnings(config, ram_total=None, disk_enabled=True, disk_free=0, disk_used=TiB) == []
    assert sizing_warnings(config, ram_total=None, disk_enabled=False, disk_free=0) == []
    assert configured_budgets(config)["disk_limit"] == TiB and configured_budgets(config)["ram_used"] == 0


def test_config_budgets_become_the_servers_environment_and_flags_win(isolated: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config = isolated / "apcctl.toml"
    spec, _ = server_spec(None, str(isolated), None, None, None, ("APC_LINEAGE_ANCHOR_MAX_ENTRIES=5",), config, ())
    assert spec.name == "sized"
    assert spec.env["APC_LINEAGE_RAM_BUDGET_BYTES"] == "1T" and spec.env["APC_LINEAGE_DISK_MAX_BYTES"] == "65536T"
    assert spec.env["APC_LINEAGE_ANCHOR_MAX_BYTES"] == "2G"
    assert spec.env["APC_LINEAGE_ANCHOR_MAX_ENTRIES"] == "5"  # -e beats the config's max_anchors = 3
    monkeypatch.setenv("APC_LINEAGE_RAM_BUDGET_BYTES", "8G")  # and the environment beats it too
    spec, _ = server_spec(None, str(isolated), None, None, None, (), config, ())
    assert spec.env["APC_LINEAGE_RAM_BUDGET_BYTES"] == "8G"


def test_a_bad_budget_in_the_config_is_a_usage_error(isolated: Path) -> None:
    (isolated / "bad.toml").write_text('[servers.x]\nram_budget = "lots"\n')
    result = apcctl("serve", "--config", str(isolated / "bad.toml"), "--model", str(isolated),
                    code=ExitStatus.USAGE)
    assert "ram_budget" in result.output and "not a size" in result.output


@pytest.mark.server
def test_budgets_and_free_space_show_before_the_first_request(isolated: Path, tiny_model_dir: Path) -> None:
    from tests.server_harness import free_port

    config = str(isolated / "apcctl.toml")
    served = apcctl("serve", "--config", config, "--model", str(tiny_model_dir), "--port", str(free_port()))
    assert "budgets: RAM 1.0 TiB" in served.stdout and "anchors 3 / 2.0 GiB" in served.stdout
    assert "warning: RAM budget 1.0 TiB exceeds physical memory" in served.stderr
    assert "warning: disk cap 65536.0 TiB exceeds the free space" in served.stderr
    try:
        body = json.loads(apcctl("status", "--config", config, "--json").stdout)
        assert body["status"]["lineage"] is None  # no request yet: the cache does not exist
        sizing = body["status"]["sizing"]
        assert sizing["budgets"]["ram_limit"] == TiB and sizing["budgets"]["anchor_count_limit"] == 3
        assert sizing["budgets"]["disk_limit"] == 65536 * TiB
        assert sizing["disk"]["free_bytes"] > 0 and sizing["disk"]["path"].endswith("lineage-disk")
        assert sizing["ram_total_bytes"] > 0 and len(sizing["warnings"]) == 2
        screen = apcctl("status", "--config", config).stdout
        assert "0 B / 1.0 TiB" in screen and "free of" in screen and "exceeds physical memory" in screen
        assert json.loads(apcctl("entries", "--config", config, "--json").stdout) == []  # not a 409
        log = (isolated / "state" / "servers" / "sized" / "server.log").read_text()
        assert "server_patch.launch: WARNING: RAM budget 1.0 TiB exceeds physical memory" in log
        watch = subprocess.Popen([sys.executable, "-m", "apcctl.cli", "status", "--config", config, "--json",
                                  "--watch", "0.2"], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        try:
            assert watch.stdout is not None
            ticks = [json.loads(watch.stdout.readline()) for _ in range(2)]  # one object per line, again and again
        finally:
            watch.terminate()
            watch.wait(timeout=10)
        assert [t["status"]["sizing"]["budgets"]["ram_limit"] for t in ticks] == [TiB, TiB]
    finally:
        apcctl("stop", "--config", config)
