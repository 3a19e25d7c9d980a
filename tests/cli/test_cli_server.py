"""apcctl through click's CliRunner against a real patched server it started with ``apcctl serve``.

One managed server per module, in a private state dir; ``--json`` output is parsed back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from apcctl.cli import main
from apcctl.commands.common import ExitStatus
from apcctl.core.client import AdminClient, AdminError
from apcctl.core.hosts import free_port

pytestmark = pytest.mark.server

NAME = "cli"


def run(*args: str, code: int = 0, input: str | None = None) -> Result:
    """Invoke apcctl; the exit code must be ``code``."""
    result = CliRunner().invoke(main, list(args), input=input)
    assert result.exit_code == code, f"apcctl {' '.join(args)} -> {result.exit_code}\n{result.output}"
    return result


def run_json(*args: str) -> Any:
    return json.loads(run(*args, "--json").stdout)


def serve(name: str, model: Path) -> dict[str, Any]:
    return run_json("serve", "--name", name, "--model", str(model), "--port", str(free_port()))


@pytest.fixture(scope="module")
def served(cli_env: Path, tiny_model_dir: Path) -> dict[str, Any]:
    return serve(NAME, tiny_model_dir)


@pytest.fixture(scope="module")
def client(served: dict[str, Any]) -> AdminClient:
    token = (Path(served["state_dir"]) / "admin-token").read_text().strip()
    return AdminClient(served["url"], token)


def chat(client: AdminClient, system: str, user: str) -> dict[str, Any]:
    """One chat request; returns its timing record from /admin/requests."""
    seen = max((r["seq"] for r in client.requests()), default=0)
    client.chat([{"role": "system", "content": system}, {"role": "user", "content": user}], max_tokens=2,
                temperature=0.0, timeout=120, model=client.status()["server"]["model"])
    return client.requests(since=seen)[-1]


def test_serve_writes_its_state_files_and_runs_the_patched_server(served: dict[str, Any]) -> None:
    state = Path(served["state_dir"])
    spec = json.loads((state / "server.json").read_text())
    assert "server_patch.launch" in spec["argv"] and spec["env"]["APC_ENABLED"] == "1"
    assert int((state / "server.pid").read_text().split()[0]) == served["pid"]
    assert oct((state / "admin-token").stat().st_mode & 0o777) == "0o600"
    assert "overlay installed" in run("logs", "--server", NAME, "-n", "200").output


def test_serve_refuses_a_running_name_and_a_busy_port(served: dict[str, Any], tiny_model_dir: Path) -> None:
    again = run("serve", "--name", NAME, "--model", str(tiny_model_dir), code=ExitStatus.FAILED)
    assert "already running" in again.output
    port = served["url"].rsplit(":", 1)[1]
    busy = run("serve", "--name", "other", "--model", str(tiny_model_dir), "--port", port, code=ExitStatus.FAILED)
    assert "already in use" in busy.output


def test_status_carries_the_hit_summary_before_the_cache_starts(served: dict[str, Any], client: AdminClient) -> None:
    """``hits`` is the server's own summary from the first second (zeros, no rates), so no reader
    rebuilds an empty one; ``apcctl status --json`` passes it through."""
    body = client.status()
    assert body["lineage"] is None  # no request yet: the cache does not exist
    assert body["hits"] == {"requests": 0, "hits": 0, "hit_rate": None, "by_kind": {}, "disk_by_point": {},
                            "cancelled_queued": 0, "reused_tokens": 0, "prefill_tokens": 0, "token_hit_rate": None}
    assert run_json("status", "--server", NAME)["hits"] == body["hits"]


def test_status_json_has_process_budgets_and_hits(served: dict[str, Any], client: AdminClient) -> None:
    chat(client, "You are the status test assistant. " * 6, "hello")
    status = run_json("status", "--server", NAME)
    assert status["server"] == NAME and status["managed"] is True
    assert status["status"]["server"]["pid"] == served["pid"]
    assert status["process"]["rss_bytes"] > 0 and status["process"]["pid"] == served["pid"]
    assert status["status"]["lineage"]["budgets"]["entries"] >= 1
    assert status["hits"]["requests"] >= 1
    human = run("status", "--server", NAME).output
    for word in ("RSS", "hit rate", "anchors", "in flight"):
        assert word in human
    by_url = run_json("status", "--server", served["url"])  # a URL finds the managed server's token
    assert by_url["server"] == NAME


def test_all_covers_every_managed_server(served: dict[str, Any]) -> None:
    statuses = run_json("status", "--all")
    assert [s["server"] for s in statuses] == [NAME]


def test_a_config_file_names_the_server(cli_env: Path, served: dict[str, Any],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    config = cli_env / "apcctl.toml"
    config.write_text(f'[servers.byconfig]\nurl = "{served["url"]}"\n'
                      f'token_file = "{Path(served["state_dir"]) / "admin-token"}"\n')
    assert run_json("status", "--config", str(config), "--server", "byconfig")["server"] == "byconfig"
    monkeypatch.setenv("APCCTL_CONFIG", str(config))
    assert run_json("status")["server"] == "byconfig"  # the only server in the file is the default


def test_wrong_token_exits_4(served: dict[str, Any]) -> None:
    result = run("status", "--server", NAME, "--token", "wrong", code=ExitStatus.AUTH)
    assert "401" in result.output


@pytest.mark.parametrize("args", [["anchors", "pin", "nope"], ["anchors", "unpin", "nope"],
                                  ["anchors", "evict", "nope"], ["entries", "nope"]])
def test_unknown_id_exits_5(served: dict[str, Any], args: list[str]) -> None:
    assert "nope" in run(*args, "--server", NAME, code=ExitStatus.NOT_FOUND).output


def test_new_anchor_is_hit_by_a_new_session_and_misses_once_evicted(cli_env: Path, client: AdminClient) -> None:
    system = "You are the anchor command test assistant. Cite the file and the line. " * 3
    (cli_env / "system.txt").write_text(system)
    made = run_json("anchors", "new", "--server", NAME, "--system-file", str(cli_env / "system.txt"))
    anchor = made["anchor"]["id"]
    assert made["created"] and made["anchor"]["pinned"]
    assert anchor in {a["id"] for a in run_json("anchors", "list", "--server", NAME)}

    hit = chat(client, system, "first session")
    assert (hit["restore_kind"], hit["entry_id"]) == ("anchor", anchor)

    evicted = run_json("anchors", "evict", anchor, "--server", NAME)
    assert evicted["evicted"] == anchor and evicted["freed_bytes"] > 0
    assert anchor not in {a["id"] for a in run_json("anchors", "list", "--server", NAME)}
    miss = chat(client, system, "second session after the eviction")
    assert miss["entry_id"] != anchor and miss["restore_kind"] != "anchor"


def test_new_anchor_rejects_a_tools_file_that_is_not_a_list(cli_env: Path, served: dict[str, Any]) -> None:
    (cli_env / "s.txt").write_text("You are short.")
    (cli_env / "tools.json").write_text('{"not": "a list"}')
    run("anchors", "new", "--server", NAME, "--system-file", str(cli_env / "s.txt"), "--tools-file",
        str(cli_env / "tools.json"), code=ExitStatus.USAGE)


def test_pin_and_unpin_a_conversation_entry(client: AdminClient) -> None:
    chat(client, "You are the pin test assistant. " * 5, "pin me")
    entry = run_json("entries", "--server", NAME, "--kind", "conversation")[0]
    pinned = run_json("anchors", "pin", entry["id"], "--server", NAME)
    assert pinned["pinned"] is True and pinned["kind"] == "anchor"
    assert run_json("anchors", "unpin", entry["id"], "--server", NAME)["pinned"] is False
    assert f"{NAME}: pinned {entry['id']}" in run("anchors", "pin", entry["id"], "--server", NAME).output


def test_entries_json_one_entry_and_the_table(client: AdminClient) -> None:
    rows = run_json("entries", "--server", NAME)
    assert rows and {"id", "kind", "tier", "length", "bytes", "checkpoints"} <= set(rows[0])
    one = run_json("entries", rows[0]["id"], "--server", NAME)
    assert one["id"] == rows[0]["id"]
    table = run("entries", "--server", NAME, "--checkpoints").output
    assert rows[0]["id"] in table and "TOKENS" in table
    assert all(r["kind"] == "anchor" for r in run_json("entries", "--server", NAME, "--kind", "anchor"))


def test_requests_table_json_and_follow(client: AdminClient) -> None:
    chat(client, "You are the requests test assistant. " * 5, "one")
    records = run_json("requests", "--server", NAME)
    assert records and {"seq", "restore_kind", "ttft_ms", "prefill_ms"} <= set(records[0])
    assert "TTFT ms" in run("requests", "--server", NAME).output
    followed = run("requests", "--server", NAME, "--follow", "--count", "2", "--interval", "0.1", "--json").stdout
    assert [json.loads(line)["seq"] for line in followed.splitlines()] == [r["seq"] for r in records[:2]]
    streamed = run("requests", "--server", NAME, "--follow", "--sse", "--count", "1", "--json").stdout
    assert json.loads(streamed.splitlines()[0])["seq"] == records[0]["seq"]


def test_drain_and_undrain(client: AdminClient) -> None:
    drained = run_json("drain", "--server", NAME, "--retry-after", "3")
    assert drained["draining"] is True and drained["retry_after_s"] == 3
    try:
        with pytest.raises(AdminError) as refused:
            chat(client, "You are drained.", "hello")
        assert refused.value.status == 503
    finally:
        assert run_json("undrain", "--server", NAME)["draining"] is False
    chat(client, "You are undrained.", "hello")


def test_flush(client: AdminClient) -> None:
    chat(client, "You are the flush test assistant. " * 5, "write me")
    flushed = run_json("flush", "--server", NAME)
    assert flushed["server"] == NAME and flushed["complete"] is True and flushed["disk_enabled"] is True


def test_report_reads_the_servers_journal(client: AdminClient) -> None:
    records = client.requests(limit=5000)
    summary = run_json("report", "--server", NAME, "--since", "1h")
    assert summary["window"]["server_starts"] == 1 and summary["window"]["files"] >= 1
    assert summary["requests"]["count"] == len(records)
    kinds = {r["restore_kind"] for r in records}
    assert set(summary["requests"]["by_kind"]) == kinds
    assert summary["requests"]["reused_tokens"] == sum(r["restored_tokens"] for r in records)
    assert summary["latency_ms"]["ttft"]["max"] == pytest.approx(max(r["ttft_ms"] for r in records))
    assert summary["anchors"]["pinned"] >= 1 and summary["tiers"]
    assert summary["evictions"]["by_reason"].get("operator", 0) >= 1  # the anchor evicted above
    assert "by restore kind" in run("report", "--server", NAME, "--since", "1h").output
