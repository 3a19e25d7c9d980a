"""What the operator asks for applies, or is refused at once saying why (issue 36, items 1-5, 16).

CLI-only behaviour through click's CliRunner on records written the way ``apcctl serve`` writes
them (no process); what involves the server through real ``apcctl serve`` processes on the tiny
model: a stopped server started again from its record, a server running with a value it cannot
read, and a restart whose new process dies at start.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
from click.testing import CliRunner, Result

from apcctl.cli import main
from apcctl.commands.common import ExitStatus
from apcctl.core.client import AdminClient
from apcctl.core.hosts import free_port
from apcctl.core.manage import ManagedServer, build_spec, failure_cause
from server_patch.admin.views import sizing_view, sizing_warnings
from server_patch.disk_paths import volume_usage
from server_patch.lineage.config import LineageConfig

RAM = "APC_LINEAGE_RAM_BUDGET_BYTES"
JOURNAL_MAX = "APC_JOURNAL_MAX_BYTES"


def run(*args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == code, f"apcctl {' '.join(args)} -> {result.exit_code}\n{result.output}"
    return result


def recorded(name: str, model: Path, **env: str) -> ManagedServer:
    """A stopped server's record, as ``serve`` leaves it (``env`` as if given with ``-e``)."""
    server = ManagedServer(name)
    server.save(build_spec(name, model=str(model), port=free_port(), env=env))
    return server


# ---------------------------------------------------------------------- item 4: unknown options


@pytest.mark.parametrize(("typed", "meant"), [("--prot", "--port"), ("--modle", "--model")])
def test_an_unknown_serve_option_is_a_usage_error_with_a_suggestion(cli_env: Path, typed: str, meant: str) -> None:
    out = run("serve", typed, "53601", code=ExitStatus.USAGE).output
    assert f"No such option '{typed}'" in out and meant in out and "Did you mean" in out
    assert "usage: mlx" not in out.lower()  # nothing reached mlx-vlm


def test_only_what_follows_double_dash_reaches_mlx_vlm(cli_env: Path, tiny_model_dir: Path) -> None:
    stray = run("serve", "--model", str(tiny_model_dir), "--max-kv-size", code=ExitStatus.USAGE).output
    assert "No such option '--max-kv-size'" in stray
    assert "[-- MLX_VLM_ARGS...]" in run("serve", "--help").output


# ---------------------------------------------------------------------- item 3: values checked in the plan


def test_a_value_the_server_cannot_read_is_refused_by_serve_and_by_the_restart_plan(
        cli_env: Path, tiny_model_dir: Path) -> None:
    bad = run("serve", "--model", str(tiny_model_dir), "-e", f"{JOURNAL_MAX}=64Q", code=ExitStatus.USAGE).output
    assert f"{JOURNAL_MAX}='64Q' is not a size" in bad
    recorded("planned", tiny_model_dir)
    plan = run("restart", "--server", "planned", "--dry-run", "-e", f"{JOURNAL_MAX}=64Q", code=ExitStatus.USAGE)
    assert f"{JOURNAL_MAX}='64Q' is not a size" in plan.output
    typo = run("restart", "--server", "planned", "--dry-run", "-e", "APC_JOURNAL_MAX_BYTE=64M",
               code=ExitStatus.USAGE).output
    assert "APC_JOURNAL_MAX_BYTE is not a setting (did you mean APC_JOURNAL_MAX_BYTES?)" in typo
    assert f"change {JOURNAL_MAX}: (unset) -> 64M" in run("restart", "--server", "planned", "--dry-run",
                                                           "-e", f"{JOURNAL_MAX}=64M").output
    recorded("bad-record", tiny_model_dir, **{JOURNAL_MAX: "64Q"})  # started before serve checked values
    kept = run("restart", "--server", "bad-record", "--dry-run", code=ExitStatus.USAGE).output
    assert f"bad-record: in the recorded command, {JOURNAL_MAX}='64Q' is not a size" in kept
    assert "restart -e KEY=VALUE" in kept
    run("restart", "--server", "bad-record", "--dry-run", "-e", f"{JOURNAL_MAX}=64M")


# ---------------------------------------------------------------------- item 1: what the config does not change


def test_the_plan_names_a_config_key_that_an_earlier_e_overrides(cli_env: Path, tiny_model_dir: Path) -> None:
    config = cli_env / "override.toml"
    config.write_text('[servers.overridden]\nram_budget = "1G"\nanchor_budget = "2G"\n')
    recorded("overridden", tiny_model_dir, **{RAM: "8G"})  # as after `serve -e APC_LINEAGE_RAM_BUDGET_BYTES=8G`
    out = run("restart", "--config", str(config), "--server", "overridden", "--dry-run").output
    assert "change APC_LINEAGE_ANCHOR_MAX_BYTES: (unset) -> 2G" in out  # the key nothing overrides applies
    assert (f"note: ram_budget = 1G in override.toml is overridden by {RAM}=8G from the last serve "
            f"(-e or its shell); restart -e {RAM}=1G to change it") in out
    asked = run("restart", "--config", str(config), "--server", "overridden", "--dry-run", "-e", f"{RAM}=1G").output
    assert f"change {RAM}: 8G -> 1G" in asked and "note:" not in asked


# ---------------------------------------------------------------------- item 5: the model and the cause


def test_the_restart_plan_checks_the_model_directory_as_serve_does(cli_env: Path, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    empty = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, empty)
    for weights in empty.glob("*.safetensors"):
        weights.unlink()
    assert "has no *.safetensors weights" in run("serve", "--model", str(empty), code=ExitStatus.USAGE).output
    recorded("weightless", tiny_model_dir)
    out = run("restart", "--server", "weightless", "--dry-run", "--model", str(empty), code=ExitStatus.USAGE).output
    assert f"model directory {empty} has no *.safetensors weights" in out
    recorded("moved", tiny_model_dir)
    spec = ManagedServer("moved").spec()
    assert spec is not None
    spec.model = spec.argv[spec.argv.index("--model") + 1] = str(tmp_path / "gone")  # moved away since serve
    ManagedServer("moved").save(spec)
    out = run("restart", "--server", "moved", "--dry-run", code=ExitStatus.USAGE).output
    assert f"moved: model directory {tmp_path / 'gone'} does not exist" in out


def test_the_cause_is_the_exception_line_not_the_help_printed_after_it() -> None:
    log = ("=== apcctl serve x at 1\nValueError: an earlier start\n=== apcctl serve x at 2\n"
           "Traceback (most recent call last):\n  File \"utils.py\", line 433, in load_model\n"
           "FileNotFoundError: \nNo safetensors found in /m\nCreate safetensors using the following code:\n"
           "```\nmodel.save_pretrained(\"<local_dir>\")\n```\n")
    assert failure_cause(log) == "FileNotFoundError: No safetensors found in /m"
    assert failure_cause("=== apcctl serve x at 3\nINFO: Uvicorn running\n") == ""


# ---------------------------------------------------------------------- item 16: the default disk cap


def test_the_default_disk_cap_is_half_the_volume_and_said_once_at_start(tmp_path: Path) -> None:
    env = {"APC_LINEAGE_DISK_PATH": str(tmp_path / "tier")}
    usage = volume_usage(tmp_path / "tier")
    assert usage is not None
    assert LineageConfig.from_env(env).disk_max_bytes == min(1 << 40, usage[0] // 2)
    assert LineageConfig.from_env({**env, "APC_LINEAGE_DISK_MAX_BYTES": "5G"}).disk_max_bytes == 5 << 30
    huge = LineageConfig(disk_max_bytes=1 << 60)  # more than any volume's free space
    assert not any("disk cap" in w for w in sizing_view(huge, env).warnings)  # every status: quiet
    (at_start,) = [w for w in sizing_view(huge, env, startup=True).warnings if "disk cap" in w]
    assert at_start.startswith("the default disk cap (half the volume, at most 1 TiB)")
    explicit = {**env, "APC_LINEAGE_DISK_MAX_BYTES": str(1 << 60)}  # the operator's own cap: every status
    assert any(w.startswith("disk cap") for w in sizing_view(huge, explicit).warnings)
    assert sizing_warnings(huge, ram_total=None, disk_enabled=True, disk_free=1 << 30,
                           disk_cap_default=True)[0].startswith("the default disk cap")


def test_the_demo_sizes_its_ram_budget_to_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from apcctl.commands.demo import demo_budget

    monkeypatch.delenv(RAM, raising=False)
    budget = int(demo_budget()[RAM])
    assert budget <= psutil.virtual_memory().total // 4 and budget <= LineageConfig.ram_budget_bytes
    monkeypatch.setenv(RAM, "2G")
    assert demo_budget() == {}  # the shell's choice stands


def test_a_recorded_start_takes_new_shell_variables_and_names_the_ones_it_does_not(
        cli_env: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 2, without a process: what ``serve --server NAME`` would start for a stopped server."""
    from apcctl.commands.serve import recorded_start

    recorded("shell", tiny_model_dir, APC_LINEAGE_ANCHOR_MAX_ENTRIES="3")
    monkeypatch.setenv("APC_LINEAGE_ANCHOR_MAX_ENTRIES", "9")  # the record's -e value wins, said so
    monkeypatch.setenv("APC_CANARY_CHUNK", "64")  # the record has none: it applies, as at a first start
    found = recorded_start("shell", None, None, None, None, (), None, None)
    assert found is not None
    spec, _, lines = found
    assert spec.env["APC_LINEAGE_ANCHOR_MAX_ENTRIES"] == "3" and spec.env["APC_CANARY_CHUNK"] == "64"
    assert "APC_CANARY_CHUNK: (unset) -> 64" in lines
    assert ("note: APC_LINEAGE_ANCHOR_MAX_ENTRIES=9 in this shell is not used: the recorded command has "
            "APC_LINEAGE_ANCHOR_MAX_ENTRIES=3 (serve -e APC_LINEAGE_ANCHOR_MAX_ENTRIES=... to change it)") in lines
    again = recorded_start("shell", None, None, None, None, ("APC_LINEAGE_ANCHOR_MAX_ENTRIES=9",), None,
                           ("--max-kv-size", "64"))
    assert again is not None
    spec, _, lines = again
    assert spec.env["APC_LINEAGE_ANCHOR_MAX_ENTRIES"] == "9" and spec.argv[-2:] == ["--max-kv-size", "64"]
    assert not any(line.startswith("note:") for line in lines)


# ---------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def served_again(cli_env: Path, tiny_model_dir: Path) -> Iterator[dict[str, Any]]:
    """One ``apcctl serve`` server for the module's two tests of a managed server (a stop and starts
    from its record, a failed restart rolled back): each leaves it running its recorded command."""
    disk = cli_env / "kept-disk"
    first = json.loads(run("serve", "--server", "again", "--model", str(tiny_model_dir), "--port",
                           str(free_port()), "--disk-path", str(disk), "-e", "APC_LINEAGE_ANCHOR_MAX_ENTRIES=3",
                           "--json", "--", "--max-kv-size", "65536").stdout)
    spec = ManagedServer("again").spec()
    assert spec is not None
    try:
        yield {"disk": disk, "url": first["url"], "spec": spec}
    finally:
        run("stop", "--server", "again")


@pytest.mark.server
def test_serve_of_a_stopped_server_starts_its_recorded_command(served_again: dict[str, Any]) -> None:
    """Item 2: a plain ``serve --server NAME`` after a stop keeps the disk path, the -e values and
    what followed --; a flag given now overrides the record, and the output says what changed."""
    disk, before = served_again["disk"], ManagedServer("again").spec()
    assert before is not None and (before.argv, before.env) == (served_again["spec"].argv, served_again["spec"].env)
    run("stop", "--server", "again")
    again = run("serve", "--server", "again")  # no --model, no config file: the record says it all
    try:
        assert "the recorded command" in again.stderr and "unchanged" in again.stderr
        after = ManagedServer("again").spec()
        assert after is not None and before is not None
        assert (after.argv, after.env, after.url) == (before.argv, before.env, served_again["url"])
        assert after.argv[-2:] == ["--max-kv-size", "65536"]
        status = json.loads(run("status", "--server", "again", "--json").stdout)["status"]
        assert status["sizing"]["disk"]["path"] == str(disk.resolve())
        assert status["sizing"]["budgets"]["anchor_count_limit"] == 3
    finally:
        run("stop", "--server", "again")
    port = free_port()
    moved = run("serve", "--server", "again", "--port", str(port), "-e", "APC_LINEAGE_ANCHOR_MAX_ENTRIES=4")
    try:
        assert "changed:" in moved.stderr and f"--port {port}" in moved.stderr
        assert "APC_LINEAGE_ANCHOR_MAX_ENTRIES: 3 -> 4" in moved.stderr
        spec = ManagedServer("again").spec()
        assert spec is not None and spec.port == port and spec.argv[-2:] == ["--max-kv-size", "65536"]
        assert spec.env["APC_LINEAGE_DISK_PATH"] == str(disk.resolve())
    except BaseException:
        run("stop", "--server", "again")
        raise


@pytest.mark.server
def test_a_server_running_with_a_value_it_cannot_read_says_so(cli_env: Path, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    """Item 3: the journal turns itself off on a bad size; /admin/status and ``status`` say so."""
    from tests.server_harness import ADMIN_TOKEN, PatchedServer

    with PatchedServer(tiny_model_dir, env={JOURNAL_MAX: "64Q"}, log_dir=tmp_path / "srv") as server:
        body = AdminClient(server.base_url, ADMIN_TOKEN).status()
        (problem,) = body["invalid_settings"]
        assert problem.startswith(f"{JOURNAL_MAX}='64Q' is not a size")
        human = run("status", "--server", server.base_url, "--token", ADMIN_TOKEN).output
        assert f"{JOURNAL_MAX}='64Q' is not a size" in human and "the server runs without it" in human


@pytest.mark.server
def test_a_failed_restart_names_the_exception_not_the_help_after_it(served_again: dict[str, Any], tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """Item 5: weights that exist but do not load pass the plan; the new process dies, the roll
    rolls back, and the verdict carries the exception line from the log."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    running = ManagedServer("again")
    if running.pid() is None:  # the other test's failure left it stopped
        run("serve", "--server", "again")
    before = running.spec()
    assert before is not None
    out = run("restart", "--server", "again", "--model", str(broken), code=ExitStatus.FAILED).output
    log = running.log_path.read_text()
    failed_start = log[:log.rindex("=== apcctl ")]  # the rollback's start is the last one
    cause = failure_cause(failed_start)
    assert cause and f"the server exited while starting: {cause}" in out
    assert "rolled back" in out
    after = running.spec()
    assert running.pid() is not None and after is not None and after.argv == before.argv  # the command it ran
