"""Issue 36 (6, 7, 8, 9, 18): every view tells the same story, against real patched servers.

One conversation on a server with the disk tier, then the same directory served again (a
restart): pinned anchors are counted wherever they are; a disk restore is ``disk`` in the
request record, ``status``' hits and Prometheus alike (its plan's kind as a second label); an
absorbed entry's 404 names its absorber and ``apcctl entries`` shows that one; an entry with
hits has a last hit; mlx-vlm's own ``/metrics`` reports the lineage cache's figures; a restart
probe's eviction is not an operator's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from apcctl.cli import main
from tests.server_harness import ADMIN_TOKEN, PatchedServer, text, wait_for

pytestmark = pytest.mark.server

SYSTEM = "You are the views test assistant. " + text(120, seed=36)
DISK = {"APC_DISK_ENABLED": "1"}


def ok(server: PatchedServer, method: str, path: str, payload: Any = None) -> Any:
    status, body = server.admin(method, path, payload)
    assert status == 200, (method, path, status, body)
    return body


def turn(server: PatchedServer, messages: list[dict[str, Any]], user: str) -> list[dict[str, Any]]:
    """One more turn of the conversation: ``messages`` with ``user``'s message and the reply."""
    asked = [*messages, {"role": "user", "content": user}]
    answer = server.chat(asked, max_tokens=4)
    return [*asked, {"role": "assistant", "content": answer["choices"][0]["message"]["content"] or "ok"}]


def metric(text_: str, line_start: str) -> float:
    return float(next(line for line in text_.splitlines() if line.startswith(line_start)).rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def story(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Server A: an anchor, a three-turn conversation, flushed to disk; stopped. Server B on the
    same directories: the conversation's fourth turn (a disk restore)."""
    logs = tmp_path_factory.mktemp("views-agree")
    facts: dict[str, Any] = {}
    with PatchedServer(tiny_model_dir, env=DISK, log_dir=logs) as first:
        ok(first, "POST", "/anchors", {"system": SYSTEM})
        messages = [{"role": "system", "content": SYSTEM}]
        for n in range(3):
            messages = turn(first, messages, f"question {n}: " + text(30, seed=n))
        facts["records_a"] = ok(first, "GET", "/requests")["requests"]
        facts["entries_a"] = ok(first, "GET", "/entries")["entries"]
        facts["events_a"] = [e for e in _cache_events(first)]
        facts["url_a"] = first.base_url
        facts["absorbed_404"] = {r["entry_id"]: first.admin("GET", f"/entries/{r['entry_id']}")
                                 for r in facts["records_a"] if r.get("entry_id")}
        facts["cli_entries"] = {i: CliRunner().invoke(main, ["entries", i, "--server", first.base_url, "--token",
                                                             ADMIN_TOKEN, "--json"])
                                for i, (status, _) in facts["absorbed_404"].items() if status == 404}
        ok(first, "POST", "/flush", {"timeout": 120})
    with PatchedServer(tiny_model_dir, env=DISK, log_dir=logs) as second:
        turn(second, messages, "question 3: " + text(30, seed=3))
        wait_for(lambda: ok(second, "GET", "/requests")["requests"], "the restored turn's record", second)
        facts["record_b"] = ok(second, "GET", "/requests")["requests"][-1]
        facts["status_b"] = ok(second, "GET", "/status")
        facts["anchors_b"] = ok(second, "GET", "/anchors")["anchors"]
        facts["prometheus_b"] = second.request("GET", "/admin/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})[1]
        facts["stock_b"] = second.get_json("/metrics")
        probe = next(a["id"] for a in facts["anchors_b"])
        facts["bad_reason"] = second.admin("DELETE", f"/entries/{probe}?reason=whim")
        facts["probe_evicted"] = second.admin("DELETE", f"/entries/{probe}?reason=restart%20probe")
        facts["events_b"] = [e for e in _cache_events(second)]
    return facts


def _cache_events(server: PatchedServer) -> list[dict[str, Any]]:
    """The cache events the server's ring holds (the event stream sends them first), read for 3 s."""
    import threading

    from apcctl.core.client import AdminClient

    stop = threading.Event()
    threading.Timer(3.0, stop.set).start()
    return [data for name, data in AdminClient(server.base_url, ADMIN_TOKEN).events(stop=stop) if name == "cache"]


def test_pinned_anchors_are_counted_wherever_they_are(story: dict[str, Any]) -> None:
    budgets = story["status_b"]["lineage"]["budgets"]
    pinned = [a for a in story["anchors_b"] if a["pinned"]]
    assert pinned, "the anchor came back from disk"
    assert budgets["anchor_count"] + budgets["pinned_on_disk"] == len(pinned)
    assert budgets["pinned_on_disk"] == sum(a["tier"] == "disk" for a in pinned)


def test_a_disk_restore_is_disk_in_every_view(story: dict[str, Any]) -> None:
    record, hits = story["record_b"], story["status_b"]["hits"]
    assert record["restore_kind"] == "disk" and record["restored_tokens"] > 0
    assert hits["by_kind"]["disk"] == 1 and sum(hits["disk_by_point"].values()) == 1
    (point, _), = [(k, v) for k, v in hits["disk_by_point"].items() if v]
    prometheus = story["prometheus_b"]
    assert metric(prometheus, 'apc_lineage_restores_total{kind="disk"}') == 1
    assert metric(prometheus, f'apc_lineage_disk_restores_total{{point="{point}"}}') == 1
    assert metric(prometheus, 'apc_lineage_anchors_pinned{tier="disk"}') == \
        story["status_b"]["lineage"]["budgets"]["pinned_on_disk"]


def test_an_absorbed_entry_names_its_absorber_and_the_cli_shows_it(story: dict[str, Any]) -> None:
    from server_patch.admin.schema import absorber_in

    held = {e["id"] for e in story["entries_a"]}
    absorbed = {i: body for i, (status, body) in story["absorbed_404"].items() if status == 404}
    assert absorbed, "a later turn absorbed an entry an earlier request restored from"
    for entry_id, body in absorbed.items():
        into = absorber_in(body["detail"])
        assert into in held, body
        result = story["cli_entries"][entry_id]
        assert result.exit_code == 0, result.output
        shown = json.loads(result.stdout)
        assert shown["id"] == into and shown["absorbed_from"] == entry_id
        assert f"{entry_id} was absorbed into {into}" in result.stderr


def test_an_entry_with_hits_has_a_last_hit(story: dict[str, Any]) -> None:
    hit = [e for e in story["entries_a"] if e["hits"]]
    assert hit and all(e["last_hit"] is not None for e in hit), hit


def test_stock_metrics_report_the_lineage_cache(story: dict[str, Any]) -> None:
    apc, hits = story["stock_b"]["server"]["apc"], story["status_b"]["hits"]
    assert apc["source"] == "apc_lineage" and "/admin/status" in apc["lineage"]["see"]
    assert apc["token_hit_rate"] == pytest.approx(hits["token_hit_rate"]) and apc["token_hit_rate"] > 0
    assert apc["lookups_hit"] == hits["hits"] and apc["disk_hits"] == hits["by_kind"]["disk"] == 1
    assert apc["restored_tokens"] == hits["reused_tokens"]


def test_a_restart_probes_eviction_is_not_an_operators(story: dict[str, Any]) -> None:
    status, body = story["bad_reason"]
    assert status == 422 and "restart probe" in body["detail"]
    status, body = story["probe_evicted"]
    assert status == 200
    evicts = [e for e in story["events_b"] if e["event"] == "evict" and e["entry_id"] == body["evicted"]]
    assert [e["detail"] for e in evicts] == ["restart probe"]
