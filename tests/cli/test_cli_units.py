"""apcctl's CLI without a server: config precedence, exit codes, rendering, the journal and its
report, and the rolling restart's logic against a fake admin client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from tests.conftest import isolate_cli
from click.testing import CliRunner

from apcctl.cli import main
from apcctl.commands import MODULES, load_all
from apcctl.commands.common import ExitStatus, exit_status_for
from apcctl.config import ConfigError, ServerConfig, Target, load_config, select
from apcctl.core import render
from apcctl.core.client import AdminError
from apcctl.core.hosts import free_port
from apcctl.core.manage import ManagedServer, build_spec
from apcctl.core.process import ProcessSampler, sample_once
from apcctl.core.restart import (Phase, RestartResult, RestartStep, ServerRestart, rolling_restart,
                                 supervisor_command)
from apcctl.journal_report import parse_since, percentiles, read_journal, report, summarize
from server_patch.admin import schema as S
from server_patch.integration.journal import FILE_NAME, Journal, journal_files

REPO = Path(__file__).resolve().parents[2]
OUR_COMMANDS = ("serve", "stop", "logs", "status", "entries", "anchors", "requests", "flush", "drain", "undrain",
                "restart", "report", "demo", "service", "check", "verify")


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Private state and config dirs; no token or server from the developer's shell."""
    return isolate_cli(monkeypatch, tmp_path)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "apcctl.toml"
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------ config


def test_config_file_names_servers_and_flags_win_over_it(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    path = write_config(tmp_path, f"""
default = "b"
[servers.a]
url = "http://10.0.0.1:9000"
token_file = "{tmp_path / 'tok'}"
[servers.b]
port = 8123
supervisor = "launchd"
service = "com.example.apc"
""")
    (b,) = select(config_path=path)
    assert (b.name, b.url, b.settings.supervisor, b.settings.service) == ("b", "http://127.0.0.1:8123", "launchd",
                                                                          "com.example.apc")
    (a,) = select("a", config_path=path)
    assert (a.url, a.token) == ("http://10.0.0.1:9000", "from-file")
    (a,) = select("a", token="from-flag", config_path=path)
    assert a.token == "from-flag"
    assert [t.name for t in select(config_path=path, all_servers=True)] == ["a", "b"]


def test_environment_is_read_by_the_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, '[servers.a]\nurl = "http://127.0.0.1:1"\n')
    monkeypatch.setenv("APCCTL_CONFIG", str(path))
    monkeypatch.setenv("APCCTL_SERVER", "a")
    monkeypatch.setenv("APCCTL_TOKEN", "env-token")
    result = CliRunner().invoke(main, ["status", "--json"])
    assert result.exit_code == ExitStatus.UNREACHABLE
    assert "a: cannot reach http://127.0.0.1:1" in result.output
    flag = CliRunner().invoke(main, ["status", "--server", "http://127.0.0.1:2"])
    assert "cannot reach http://127.0.0.1:2" in flag.output


def test_default_config_path_may_be_missing_but_a_given_one_may_not(tmp_path: Path) -> None:
    assert load_config().servers == {}
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = write_config(tmp_path, "[servers.a]\nurl = 'x'\nfoo = 1\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        load_config(bad)
    result = CliRunner().invoke(main, ["status", "--config", str(bad)])
    assert result.exit_code == ExitStatus.USAGE


def test_top_fleet_names_a_missing_fleet_and_exits_not_found() -> None:
    for args in (["top", "--fleet"], ["top", "--fleet", "edge"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == ExitStatus.NOT_FOUND, result.output
        assert "no fleet" in result.output and "apcctl fleet up" in result.output


def test_top_fleet_reads_the_config_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet's name comes from ``--config`` (or APCCTL_CONFIG), not only from the default file."""
    config = write_config(tmp_path, "[servers.a]\nurl = 'http://127.0.0.1:2'\n\n[fleet]\nname = 'edge'\nservers = ['a']\n")
    result = CliRunner().invoke(main, ["top", "--fleet", "--config", str(config)])
    assert result.exit_code == ExitStatus.NOT_FOUND, result.output
    assert "no fleet 'edge'" in result.output
    monkeypatch.setenv("APCCTL_CONFIG", str(config))
    result = CliRunner().invoke(main, ["top", "--fleet"])
    assert result.exit_code == ExitStatus.NOT_FOUND and "no fleet 'edge'" in result.output, result.output
    bad = write_config(tmp_path, "[fleet]\nname = 'edge'\nservers = ['nosuch']\n")
    result = CliRunner().invoke(main, ["top", "--fleet", "--config", str(bad)])
    assert result.exit_code == ExitStatus.USAGE and "nosuch" in result.output, result.output


def test_unknown_server_name_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["entries", "--server", "nosuch"])
    assert result.exit_code == ExitStatus.USAGE
    assert "unknown server 'nosuch'" in result.output


def test_a_managed_server_is_found_by_name_and_by_url_with_its_token(tmp_path: Path) -> None:
    server = ManagedServer("m1")
    spec = build_spec("m1", model=str(tmp_path), port=18999)
    server.save(spec)
    server.token_path.write_text("managed-token\n")
    (by_name,) = select("m1")
    (by_url,) = select("http://127.0.0.1:18999")
    assert by_name.url == by_url.url == "http://127.0.0.1:18999"
    assert by_name.token == by_url.token == "managed-token"
    assert by_url.managed is not None and by_url.managed.name == "m1"
    assert oct(server.spec_path.stat().st_mode & 0o777) == "0o600"
    assert spec.env["APC_ENABLED"] == "1" and spec.env["APC_STATE_DIR"] == str(server.directory)
    assert spec.env["APC_LINEAGE_DISK_PATH"] == str(server.directory / "lineage-disk")


# ------------------------------------------------------------------ exit codes and help


@pytest.mark.parametrize("status, code", [(0, 3), (401, 4), (403, 4), (404, 5), (409, 1), (500, 1), (422, 1)])
def test_http_status_to_exit_code(status: int, code: int) -> None:
    assert exit_status_for(AdminError(status, "x")) == code


def test_unreachable_server_exits_3_for_every_read_command() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["status"], ["entries"], ["anchors", "list"], ["requests"], ["flush"], ["drain"]):
        result = CliRunner().invoke(main, [*args, "--server", url, "--json"])
        assert result.exit_code == ExitStatus.UNREACHABLE, (args, result.output)


def test_stop_and_logs_of_an_unmanaged_server_exit_5() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert CliRunner().invoke(main, ["stop", "--server", url]).exit_code == ExitStatus.NOT_FOUND
    assert CliRunner().invoke(main, ["logs", "--server", url]).exit_code == ExitStatus.NOT_FOUND


def test_main_help_lists_the_exit_codes() -> None:
    result = CliRunner().invoke(main, ["--help"])
    for line in ("0  ok", "2  usage error", "3  server unreachable", "4  authentication failed", "5  not found"):
        assert line in result.output


def _commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    load_all()  # command modules load lazily: walk them all
    out = []
    for name, command in group.commands.items():
        out.append((prefix + name, command))
        if isinstance(command, click.Group):
            out += _commands(command, prefix + name + " ")
    return out


@pytest.mark.parametrize("name, command", [c for c in _commands(main) if c[0].split()[0] in OUR_COMMANDS])
def test_every_command_has_help_and_a_section_in_the_docs(name: str, command: click.Command) -> None:
    assert command.help, f"{name} has no help"
    assert f"`apcctl {name}" in (REPO / "docs" / "cli.md").read_text(encoding="utf-8"), f"docs/cli.md lacks {name}"


def test_command_modules_are_registered() -> None:
    for module in ("serve", "status", "entries", "anchors", "requests", "ops", "restart", "report", "demo"):
        assert module in MODULES
    assert set(OUR_COMMANDS) <= set(main.commands)


# ------------------------------------------------------------------ rendering


def test_human_sizes_and_durations() -> None:
    assert render.human_bytes(0) == "0 B"
    assert render.human_bytes(1536) == "1.5 KiB"
    assert render.human_bytes(3 * 1024**3) == "3.0 GiB"
    assert render.human_bytes(None) == "-"
    assert render.human_duration(5.25) == "5.2s"
    assert render.human_duration(3725) == "1h 2m"
    assert render.human_duration(2 * 86400 + 3600) == "2d 1h"
    assert render.percent(1, 4) == "25.0%" and render.percent(1, 0) == "-"


def test_restore_label_says_when_the_entry_lent_its_buffer() -> None:
    from apcctl.commands.requests import format_request
    from tui.columns import request_columns
    from tui.state import Keyed

    lent = {"seq": 3, "started": 0.0, "restore_kind": "entry", "kv_admission": "lent", "prompt_tokens": 900,
            "restored_tokens": 899, "lookup_ms": 1.0, "admission_ms": 2.0, "prefill_ms": 3.0, "commit_ms": 0.0,
            "ttft_ms": 9.0, "entry_id": "abc"}
    copied = dict(lent, kv_admission="copied")
    assert render.restore_label(lent) == "entry/lent" and render.restore_label(copied) == "entry"
    assert render.restore_label({**lent, "kv_admission": "staged"}) == "entry/staged"
    assert render.restore_label({"restore_kind": "cold"}) == "cold"
    assert " entry/lent " in format_request(lent) and " entry " in format_request(copied)
    kind = next(c for c in request_columns() if c.key == "restore_kind")
    cell = kind.cell(Keyed("3", lent))
    assert cell.plain == "entry/lent" and str(cell.style) == "green"


# ------------------------------------------------------------------ journal and report


def test_journal_rotates_at_its_size_cap_and_keeps_a_fixed_number_of_files(tmp_path: Path) -> None:
    journal = Journal(tmp_path, max_bytes=1024, files=3)
    for i in range(200):
        journal.append({"type": "request", "time": float(i), "seq": i, "pad": "x" * 40})
    journal.close()
    files = journal_files(tmp_path)
    assert [f.name for f in files] == [f"{FILE_NAME}.2", f"{FILE_NAME}.1", FILE_NAME]
    assert all(f.stat().st_size <= 1024 for f in files)
    seqs = [r["seq"] for r in read_journal(tmp_path)]
    assert seqs == sorted(seqs) and seqs[-1] == 199  # oldest first, nothing newer lost


def test_torn_and_foreign_lines_are_skipped(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_text('{"type":"request","time":1}\nnot json\n{"no":"time"}\n{"type":"cac')
    assert [r["time"] for r in read_journal(tmp_path)] == [1]


def test_parse_since() -> None:
    assert parse_since("30m", now=10_000) == 10_000 - 1800
    assert parse_since("7d", now=10**7) == 10**7 - 7 * 86400
    assert parse_since("2026-11-01") > 0
    with pytest.raises(ValueError, match="not a span"):
        parse_since("yesterday")


def test_percentiles_use_nearest_rank() -> None:
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "max": None}
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}


def _journal_records() -> list[dict[str, Any]]:
    def request(t: float, kind: str, restored: int, ttft: float) -> dict[str, Any]:
        return {"type": "request", "time": t, "restore_kind": kind, "restored_tokens": restored,
                "prompt_tokens": 100, "lookup_ms": 1.0, "admission_ms": 2.0, "prefill_ms": ttft - 5,
                "commit_ms": 1.0, "ttft_ms": ttft}

    return [
        {"type": "start", "time": 1.0, "pid": 1},
        {"type": "budgets", "time": 1.0, "ram_used": 0, "anchor_bytes": 0, "disk_used": 0, "anchor_count": 0},
        request(2.0, "cold", 0, 100.0),
        {"type": "cache", "time": 2.0, "event": "pin", "entry_id": "a1", "bytes": 10, "detail": "captured"},
        request(3.0, "anchor", 90, 20.0),
        request(4.0, "anchor", 90, 30.0),
        {"type": "cache", "time": 4.5, "event": "evict", "entry_id": "c1", "bytes": 500, "detail": "ram budget"},
        {"type": "cache", "time": 4.6, "event": "disk_write", "entry_id": "a1", "bytes": 64},
        {"type": "start", "time": 5.0, "pid": 2},
        request(6.0, "disk", 80, 40.0),
        {"type": "budgets", "time": 6.0, "ram_used": 700, "anchor_bytes": 10, "disk_used": 64, "anchor_count": 1},
    ]


def test_summary_splits_hits_by_kind_and_latency_by_phase() -> None:
    s = summarize(_journal_records(), since=0, until=10)
    assert s["window"]["server_starts"] == 2
    assert s["requests"]["count"] == 4 and s["requests"]["hits"] == 3
    assert s["requests"]["by_kind"]["anchor"] == {"requests": 2, "reused_tokens": 180, "prompt_tokens": 200}
    assert s["requests"]["reused_tokens"] == 260 and s["requests"]["token_hit_rate"] == 260 / 400
    assert s["latency_ms"]["ttft"]["max"] == 100.0 and s["latency_ms"]["ttft"]["p50"] == 30.0
    assert s["evictions"] == {"count": 1, "bytes": 500, "by_reason": {"ram budget": 1}, "disk_deletes": {}}
    assert s["disk"]["writes"] == 1 and s["anchors"]["pinned"] == 1 and s["anchors"]["pinned_now"] == 1
    assert [t["ram_bytes"] for t in s["tiers"]] == [0, 700]


def test_report_command_reads_a_journal_directory(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    for record in _journal_records():
        journal.append(record)
    journal.close()
    result = CliRunner().invoke(main, ["report", "--journal", str(tmp_path / "j"), "--since", "1970-01-01", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"]["count"] == 4
    assert report(tmp_path / "j", since=3.5, until=10)["requests"]["count"] == 2
    human = CliRunner().invoke(main, ["report", "--journal", str(tmp_path / "j"), "--since", "1970-01-01"])
    assert "by restore kind" in human.output and "anchor" in human.output
    missing = CliRunner().invoke(main, ["report", "--journal", str(tmp_path / "none")])
    assert missing.exit_code == ExitStatus.NOT_FOUND
    bad = CliRunner().invoke(main, ["report", "--journal", str(tmp_path / "j"), "--since", "soon"])
    assert bad.exit_code == ExitStatus.USAGE


# ------------------------------------------------------------------ rolling restart logic


class FakeClient:
    """Answers like a server whose PID changes once ``restart`` was run; counts the verbs."""

    def __init__(self, in_flight: int, calls: list[str]) -> None:
        self.in_flight = in_flight
        self.calls = calls
        self.pid = 100

    # The answers typed, as ``AdminClient`` returns them (``server_patch.admin.schema``).

    def status(self) -> Any:
        return S.Status.from_json({"server": {"pid": self.pid, "model": "m"},
                                   "idle": {"in_flight": self.in_flight, "queued": 0},
                                   "lineage": {"disk_path": "/d", "budgets": ROOMY, "stats": {}}})

    def health(self) -> dict[str, Any]:
        return {"status": "healthy"}

    def entries(self) -> list[Any]:
        return []

    def anchors(self) -> list[Any]:
        return [anchor("pinned1"), anchor("probe")]

    def new_anchor(self, system: str) -> Any:
        self.calls.append("new_anchor")
        return S.NewAnchor(anchor=anchor("probe"), created=True)

    def requests(self, since: int = 0, limit: int = 200) -> list[Any]:
        if "chat" not in self.calls:
            return []
        return [S.RequestRecord(seq=1, started=0.0, prompt_tokens=40, entry_id="probe", restore_kind="disk",
                                restored_tokens=40)]

    def chat(self, messages: list, **params: Any) -> dict[str, Any]:
        self.calls.append("chat")
        return {}

    def __getattr__(self, verb: str) -> Any:  # drain, undrain, flush, evict
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(verb)
            return S.FlushReport(queued=0, written=0, failed=0, unwritten=[], pending=0, complete=True, reason=None,
                                 disk_enabled=True)

        return call


ROOMY = {"ram_used": 0, "ram_limit": 1 << 30, "conversation_bytes": 0, "disk_queue_bytes": 0, "anchor_bytes": 0,
         "anchor_bytes_limit": 1 << 30, "anchor_count": 1, "anchor_count_limit": 16, "disk_used": 0,
         "disk_limit": 1 << 30, "entries": 1, "disk_files": 0}


def anchor(entry_id: str) -> Any:
    return S.EntryInfo(id=entry_id, kind=S.EntryKind.ANCHOR, pinned=True, length=40, bytes=0, kv_bytes=0,
                       tier=S.Residence.DISK)


class FakeTarget(Target):
    def client(self, timeout: float = 10.0) -> Any:
        return self.__dict__["fake"]


def fake_target(in_flight: int, calls: list[str]) -> FakeTarget:
    target = FakeTarget("svc", "http://127.0.0.1:9", None, ServerConfig("svc", supervisor="systemd", service="apc.service"))
    object.__setattr__(target, "fake", FakeClient(in_flight, calls))
    return target


def test_restart_refuses_a_server_it_could_not_start_again_before_touching_anything() -> None:
    steps: list[RestartStep] = []
    target = Target("bare", "http://127.0.0.1:1", None, ServerConfig("bare"))
    result = rolling_restart([target], on_progress=steps.append)
    assert not result.ok and result.servers[0].phase == "failed"
    assert "not started by 'apcctl serve'" in result.servers[0].message
    assert [s.phase for s in steps] == ["failed"]


def test_restart_waits_for_in_flight_requests_and_gives_up_without_force() -> None:
    calls: list[str] = []
    commands: list[list[str]] = []
    steps: list[RestartStep] = []
    result = rolling_restart([fake_target(2, calls)], on_progress=steps.append, timeout=0.2, poll_s=0.01,
                             run_command=commands.append)
    assert not result.ok and "2 requests still in flight" in result.servers[0].message
    assert calls.count("drain") == 1 and calls[-1] == "undrain"  # the drain is lifted again
    assert commands == []  # never stopped
    assert all(s.in_flight == 2 for s in steps if s.phase == "waiting")


def test_forced_restart_under_a_supervisor_probes_the_anchor_from_disk() -> None:
    calls: list[str] = []
    target = fake_target(1, calls)
    fake = target.client()

    def restart_service(argv: list[str]) -> None:
        commands.append(argv)
        fake.pid, fake.in_flight = 200, 0

    commands: list[list[str]] = []
    steps: list[RestartStep] = []
    result = rolling_restart([target], on_progress=steps.append, timeout=0.1, poll_s=0.01, force=True,
                             run_command=restart_service)
    assert result.ok, result.servers[0].message
    assert commands == [supervisor_command("systemd", "apc.service")]
    server = result.servers[0]
    assert (server.old_pid, server.new_pid) == (100, 200)
    assert server.probe["restore_kind"] == "disk" and server.probe["missing_anchors"] == []
    assert any("--force" in w for w in server.warnings)
    phases = [s.phase for s in steps]
    assert phases.index("draining") < phases.index("flushing") < phases.index("stopping") < phases.index("ready") \
        < phases.index("probing") < phases.index("done")
    assert calls[-1] == "evict"  # the probe anchor is removed again


class SlowToAnswer(FakeClient):
    """A server so busy while it drains that its first two status polls time out."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__(0, calls)
        self.missed = 0

    def status(self) -> dict[str, Any]:
        if "drain" in self.calls and self.missed < 2:
            self.missed += 1
            raise AdminError(0, "cannot reach http://127.0.0.1:9: timed out")
        return super().status()


def test_a_status_poll_that_times_out_while_draining_does_not_end_the_restart() -> None:
    calls: list[str] = []
    target = fake_target(0, calls)
    fake = SlowToAnswer(calls)
    object.__setattr__(target, "fake", fake)

    def restart_service(argv: list[str]) -> None:
        fake.pid = 200

    steps: list[RestartStep] = []
    result = rolling_restart([target], on_progress=steps.append, timeout=5.0, poll_s=0.01,
                             run_command=restart_service)
    assert result.ok, result.servers[0].message
    assert fake.missed == 2 and sum("no answer to a status poll" in s.message for s in steps) == 2


def test_launchd_restart_command_uses_kickstart() -> None:
    assert supervisor_command("launchd", "com.x")[:3] == ["launchctl", "kickstart", "-k"]
    assert supervisor_command("launchd", "com.x")[3] == f"gui/{os.getuid()}/com.x"


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path: Path) -> None:
    ManagedServer("p1").save(build_spec("p1", model=str(tmp_path), port=free_port()))
    result = CliRunner().invoke(main, ["restart", "--server", "p1", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["dry_run"] and out["ok"] and out["servers"][0]["phase"] == "plan"
    assert "server_patch.launch" in out["servers"][0]["how"]


def test_restart_phases_keep_their_words_in_json_and_lines() -> None:
    """``Phase`` is a StrEnum: the JSON and the progress lines read as the bare strings always did."""
    assert [str(p) for p in Phase] == ["plan", "draining", "waiting", "flushing", "stopping", "starting", "ready",
                                       "probing", "rollback", "done", "failed"]
    result = RestartResult(False, False, [ServerRestart("a", phase=Phase.FAILED)])
    assert json.loads(json.dumps(result.as_dict()))["servers"][0]["phase"] == "failed"
    assert f"{Phase.WAITING:<9}|" == "waiting  |" and Phase("probing") is Phase.PROBING


def test_process_readings_of_a_live_and_a_gone_process() -> None:
    live = sample_once(os.getpid(), cpu_interval=0.0)
    assert live is not None and live.pid == os.getpid() and live.rss_bytes > 0 and live.threads >= 1
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert sample_once(gone.pid) is None and sample_once(None) is None
    sampler = ProcessSampler()
    first = sampler.sample(os.getpid())
    assert first is not None and first.rss_bytes > 0
    assert sampler.sample(gone.pid) is None and sampler.sample(os.getpid()) is not None  # starts over


def test_apcctl_requests_shows_the_oracle_and_the_top_lost_reason() -> None:
    from apcctl.commands.requests import COLUMNS, format_request

    record = {"seq": 4, "started": 0.0, "restore_kind": "periodic", "prompt_tokens": 5000, "restored_tokens": 2048,
              "oracle": 4096, "lost": {"thinning": 1536, "ram budget": 512}, "lookup_ms": 1.0, "admission_ms": 2.0,
              "prefill_ms": 3.0, "commit_ms": 0.0, "ttft_ms": 9.0, "entry_id": "abc"}
    line = format_request(record).split()
    assert {"ORACLE", "LOST"} <= set(COLUMNS)
    assert line[4:8] == ["2,048", "4,096", "thinned", "1,536+"]  # REUSED, ORACLE, LOST (the most tokens first)
    whole = format_request(dict(record, restored_tokens=4096, lost={})).split()
    assert whole[4:6] == ["4,096", "4,096"] and whole[6] == "1.0"  # nothing lost: a blank LOST cell


def test_apcctl_requests_shows_what_a_request_waited_for() -> None:
    from apcctl.commands.requests import COLUMNS, format_request, row

    record = {"seq": 4, "started": 0.0, "prompt_tokens": 50, "ttft_ms": 9.0, "entry_id": "abc",
              "waited_ms": 2914.4, "waited": {"restore": 1.0, "prefill": 2908.0, "commit": 5.4}, "ended": True}
    assert row(record)[COLUMNS.index("WAIT ms")] == "2,914 prefill+"
    assert format_request(record).split()[-3:] == ["2,914", "prefill+", "abc"]
    assert row(dict(record, waited_ms=0.0, waited={}))[COLUMNS.index("WAIT ms")] == ""
