"""The settings registry: every APC_* variable listed once, one size parser, ``apcctl config show``."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from apcctl.cli import main
from apcctl.config import SIZE
from tests.conftest import isolate_cli
from server_patch import settings
from server_patch.envconfig import parse_size

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No APC_* variable from the developer's shell; private state and config dirs."""
    for s in settings.registry():
        monkeypatch.delenv(s.name, raising=False)
    return isolate_cli(monkeypatch, tmp_path)


def apc_names_in_source() -> dict[str, str]:
    """Every whole ``APC_*`` string constant in server_patch/ and apcctl/ -> the first file with it."""
    found: dict[str, str] = {}
    for package in ("server_patch", "apcctl"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("APC_") \
                        and node.value.replace("_", "").isalnum() and node.value.isupper() \
                        and not node.value.endswith("_"):
                    found.setdefault(node.value, str(path.relative_to(REPO)))
    return found


# ----------------------------------------------------------------------------- the registry


def test_every_apc_variable_in_the_source_is_registered():
    registered = {s.name for s in settings.registry()}
    missing = {name: where for name, where in apc_names_in_source().items()
               if name not in registered and name not in settings.MLX_VLM_OWNED}
    assert not missing, f"register these in server_patch/settings.py: {missing}"


def test_every_setting_says_why_and_names_readers_that_name_it():
    import importlib.util

    names = [s.name for s in settings.registry()]
    assert len(names) == len(set(names))
    for s in settings.registry():
        assert s.why.strip(), f"{s.name} has no why"
        specs = [importlib.util.find_spec(r) for r in s.readers]
        assert s.readers and all(specs), s
        if s.name in {x.name for x in settings._SCALARS}:  # dataclass fields are named by their class
            for reader, spec in zip(s.readers, specs):
                assert s.name in Path(spec.origin).read_text(encoding="utf-8"), (s.name, reader)


def test_dataclass_defaults_are_the_registrys():
    from server_patch.boundaries import SegmentSettings
    from server_patch.lineage import LineageConfig

    assert settings.setting("APC_LINEAGE_RAM_BUDGET_BYTES").default == LineageConfig().ram_budget_bytes
    assert settings.setting("APC_SEGMENTS_ANCHOR_TAIL").default == SegmentSettings().anchor_tail_tokens
    assert settings.setting("APC_LINEAGE_THIN_ORDER").type == "list"
    with pytest.raises(KeyError, match="APC_NOPE"):
        settings.setting("APC_NOPE")


def test_committed_settings_md_is_the_generators_output():
    result = CliRunner().invoke(main, ["config", "show", "--markdown"])
    assert result.exit_code == 0, result.output
    assert (REPO / "docs" / "settings.md").read_text(encoding="utf-8") == result.output, \
        "docs/settings.md is stale: run `apcctl config show --markdown > docs/settings.md`"


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("raw,expected", [("64M", 64 << 20), ("48GiB", 48 << 30), ("1.5G", 3 << 29),
                                          ("4096", 4096), ("512k", 512 << 10), ("1TB", 1 << 40),
                                          (" 2 MiB ", 2 << 20), ("8e9", 8_000_000_000)])
def test_sizes_in_every_spelling(raw, expected):
    assert parse_size("APC_X_BYTES", raw) == expected


@pytest.mark.parametrize("raw", ["lots", "-5", "G", "1iB", "5X", ""])
def test_bad_sizes_name_the_variable(raw):
    with pytest.raises(ValueError, match="APC_X_BYTES.*size"):
        parse_size("APC_X_BYTES", raw)


def test_size_is_a_click_parameter_type():
    @click.command()
    @click.option("--budget", type=SIZE, default="1G")
    def budget(budget: int) -> None:
        click.echo(budget)

    runner = CliRunner()
    assert runner.invoke(budget, ["--budget", "48GiB"]).output.strip() == str(48 << 30)
    assert runner.invoke(budget, []).output.strip() == str(1 << 30)
    bad = runner.invoke(budget, ["--budget", "lots"])
    assert bad.exit_code == 2 and "--budget" in bad.output and "not a size" in bad.output


# ----------------------------------------------------------------------------- readers


def test_a_journal_size_with_a_unit_is_read(clean_env: Path, monkeypatch: pytest.MonkeyPatch):
    from server_patch.integration import journal

    monkeypatch.setenv("APC_JOURNAL_MAX_BYTES", "64M")
    monkeypatch.setenv("APC_JOURNAL_DIR", str(clean_env / "journal"))
    opened = journal.from_env()
    try:
        assert opened is not None and opened.max_bytes == 64 << 20 and opened.directory == clean_env / "journal"
    finally:
        opened.close()
    assert journal.from_env({"APC_JOURNAL": "off"}) is None
    with pytest.raises(ValueError, match="APC_JOURNAL_FILES"):
        journal.from_env({"APC_JOURNAL_FILES": "many"})


def test_disk_settings_read_through_the_registry(tmp_path: Path):
    from server_patch.disk_paths import default_disk_root, disk_enabled
    from server_patch.disk.space import min_free_from_env

    assert default_disk_root({"APC_LINEAGE_DISK_PATH": str(tmp_path)}) == tmp_path
    assert disk_enabled({}) and not disk_enabled({"APC_LINEAGE_DISK": "off"})
    with pytest.raises(ValueError, match="APC_LINEAGE_DISK"):
        disk_enabled({"APC_LINEAGE_DISK": "maybe"})
    assert min_free_from_env({"APC_LINEAGE_DISK_MIN_FREE": "7%"}) == pytest.approx(0.07)


# ----------------------------------------------------------------------------- apcctl config show


def show(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["config", "show", "--json", *args])
    return result.exit_code, (json.loads(result.stdout) if result.stdout.strip() else {})


def by_name(doc: dict) -> dict[str, dict]:
    return {row["name"]: row for row in doc["settings"]}


def test_config_show_says_where_each_value_came_from(clean_env: Path, monkeypatch: pytest.MonkeyPatch):
    config = clean_env / "config.toml"
    config.write_text('[servers.main]\nram_budget = "32G"\ndisk_budget = "200G"\n', encoding="utf-8")
    monkeypatch.setenv("APC_JOURNAL_MAX_BYTES", "64M")
    monkeypatch.setenv("APC_LINEAGE_DISK_MAX_BYTES", "1T")  # the environment wins over the file
    monkeypatch.setenv("APC_ADMIN_TOKEN", "s3cret-token")
    code, doc = show("--config", str(config), "--server", "main")
    assert code == 0
    rows = by_name(doc)
    assert len(rows) == len(settings.registry())
    assert (rows["APC_JOURNAL_MAX_BYTES"]["value"], rows["APC_JOURNAL_MAX_BYTES"]["source"]) == (64 << 20, "env")
    assert (rows["APC_LINEAGE_RAM_BUDGET_BYTES"]["value"], rows["APC_LINEAGE_RAM_BUDGET_BYTES"]["source"]) \
        == (32 << 30, "config")
    assert (rows["APC_LINEAGE_DISK_MAX_BYTES"]["value"], rows["APC_LINEAGE_DISK_MAX_BYTES"]["source"]) \
        == (1 << 40, "env")
    assert (rows["APC_JOURNAL_FILES"]["value"], rows["APC_JOURNAL_FILES"]["source"]) == (8, "default")
    # a default the reader derives is shown as it would be computed
    assert (rows["APC_JOURNAL_DIR"]["value"], rows["APC_JOURNAL_DIR"]["source"]) \
        == (str(clean_env / "state" / "journal"), "default")
    assert rows["APC_ADMIN_TOKEN"]["value"] == "(set)" and "s3cret" not in json.dumps(doc)
    code, doc = show("--changed")
    assert code == 0 and set(by_name(doc)) == {"APC_JOURNAL_MAX_BYTES", "APC_LINEAGE_DISK_MAX_BYTES",
                                            "APC_ADMIN_TOKEN", "APC_STATE_DIR"}  # (isolate_cli sets it)


def test_config_show_table_and_a_bad_value(clean_env: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("APC_SEGMENTS_TOOLS", "maybe")
    result = CliRunner().invoke(main, ["config", "show", "--changed"])
    assert result.exit_code == 2
    assert "APC_SEGMENTS_TOOLS" in result.stdout and "invalid" in result.stdout
    assert "is not a boolean" in result.stderr
    code, doc = show()
    assert code == 2 and "not a boolean" in by_name(doc)["APC_SEGMENTS_TOOLS"]["error"]
