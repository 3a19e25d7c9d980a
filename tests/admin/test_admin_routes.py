"""Every /admin route against a real patched server: good input, bad input, no token, wrong token.

One server per module (the tiny model); the tests run in file order and build on each other's
cache state only where a docstring says so.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import ADMIN_TOKEN, PatchedServer

pytestmark = pytest.mark.server

SYSTEM = "You are the route test assistant. " + "Answer with care and cite the file path. " * 6


def call(server: PatchedServer, method: str, path: str, body: Any = None, *, token: str | None = ADMIN_TOKEN,
         raw: bytes | None = None, timeout: float = 120) -> tuple[int, dict[str, str], Any]:
    """(status, headers, decoded body) of one HTTP call; errors are returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(server.base_url + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, headers, payload = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        status, headers, payload = exc.code, dict(exc.headers), exc.read()
    kind = headers.get("content-type", headers.get("Content-Type", ""))
    decoded = json.loads(payload) if "json" in kind else payload.decode()
    return status, {k.lower(): v for k, v in headers.items()}, decoded


def chat(server: PatchedServer, user: str, system: str = SYSTEM, **params: Any) -> tuple[int, dict[str, str], Any]:
    body = {"model": str(server.model_dir), "messages": [{"role": "system", "content": system},
                                                         {"role": "user", "content": user}],
            "max_tokens": 2, "temperature": 0.0, **params}
    return call(server, "POST", "/v1/chat/completions", body, token=None)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("admin-routes")) as running:
        yield running


ROUTES = [
    ("GET", "/admin/status"), ("GET", "/admin/entries"), ("GET", "/admin/entries/x"), ("DELETE", "/admin/entries/x"),
    ("GET", "/admin/anchors"), ("POST", "/admin/anchors/x/pin"), ("POST", "/admin/anchors/x/unpin"),
    ("POST", "/admin/anchors"), ("GET", "/admin/requests"), ("GET", "/admin/events"), ("GET", "/admin/metrics"),
    ("POST", "/admin/flush"), ("POST", "/admin/drain"), ("POST", "/admin/undrain"), ("GET", "/admin/openapi.json"),
]


@pytest.mark.parametrize("method, path", ROUTES)
@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_every_route_needs_the_token(server: PatchedServer, method: str, path: str, token: str | None) -> None:
    status, headers, body = call(server, method, path, {} if method == "POST" else None, token=token)
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"
    assert "admin token" in body["detail"]


def test_before_the_first_request_the_budgets_are_already_shown(server: PatchedServer) -> None:
    status, _, body = call(server, "GET", "/admin/entries")
    assert status == 200 and body["entries"] == [] and body["started"] is False
    assert body["budgets"]["ram_used"] == 0 and body["budgets"]["ram_limit"] > 0
    status, _, body = call(server, "GET", "/admin/status")
    assert status == 200 and body["lineage"] is None and body["server"]["pid"] == server.pid
    assert body["sizing"]["budgets"]["disk_limit"] > 0 and "free_bytes" in body["sizing"]["disk"]
    assert call(server, "GET", "/admin/requests")[2] == {"requests": []}


def test_status_after_a_request(server: PatchedServer) -> None:
    assert chat(server, "first question")[0] == 200
    status, _, body = call(server, "GET", "/admin/status")
    assert status == 200
    assert body["server"]["mlx_vlm_version"] == "0.7.10"
    assert set(body["idle"]) >= {"in_flight", "draining", "queued", "retry_after_s"}
    lineage = body["lineage"]
    assert lineage["budgets"]["entries"] >= 1 and lineage["stats"]["lookups"] >= 1
    assert lineage["disk_path"]
    # The server's own hit summary: every request counted once by how it started.
    hits, stats = body["hits"], lineage["stats"]
    assert hits["requests"] == sum(v for k, v in stats.items() if k.startswith("hits_")) >= 1
    assert hits["by_kind"]["cold"] == stats["hits_cold"] and hits["hits"] == hits["requests"] - stats["hits_cold"]
    assert hits["prefill_tokens"] == stats["prefill_tokens"] > 0


def test_entries_filters_and_rejects_bad_filters(server: PatchedServer) -> None:
    status, _, body = call(server, "GET", "/admin/entries?tier=all&kind=all")
    assert status == 200 and body["entries"]
    kinds = {e["kind"] for e in body["entries"]}
    assert kinds <= {"conversation", "anchor"}
    anchors = call(server, "GET", "/admin/entries?kind=anchor")[2]["entries"]
    assert all(e["kind"] == "anchor" for e in anchors) and anchors  # the system prompt was anchored
    assert all(e["tier"] == "disk" for e in call(server, "GET", "/admin/entries?tier=disk")[2]["entries"])
    for query in ("tier=ssd", "kind=other", "tier="):
        status, _, body = call(server, "GET", f"/admin/entries?{query}")
        assert status == 422 and isinstance(body["detail"], list)


def test_one_entry_and_unknown_ids(server: PatchedServer) -> None:
    entry = call(server, "GET", "/admin/entries")[2]["entries"][0]
    status, _, body = call(server, "GET", f"/admin/entries/{entry['id']}")
    assert status == 200 and body["id"] == entry["id"] and "checkpoints" in body
    for method, path in (("GET", "/admin/entries/nope"), ("DELETE", "/admin/entries/nope"),
                         ("POST", "/admin/anchors/nope/pin"), ("POST", "/admin/anchors/nope/unpin")):
        status, _, body = call(server, method, path)
        assert status == 404 and "nope" in body["detail"], (method, path)


def test_pin_unpin_and_evict_a_conversation_entry(server: PatchedServer) -> None:
    """A conversation entry pinned becomes an anchor; unpinned it stays one but unpinned; evicted it is gone."""
    conversation = call(server, "GET", "/admin/entries?kind=conversation")[2]["entries"][0]
    status, _, pinned = call(server, "POST", f"/admin/anchors/{conversation['id']}/pin")
    assert status == 200 and pinned["pinned"] is True and pinned["kind"] == "anchor"
    assert conversation["id"] in {a["id"] for a in call(server, "GET", "/admin/anchors")[2]["anchors"]}
    status, _, unpinned = call(server, "POST", f"/admin/anchors/{conversation['id']}/unpin")
    assert status == 200 and unpinned["pinned"] is False
    status, _, evicted = call(server, "DELETE", f"/admin/entries/{conversation['id']}")
    assert status == 200 and evicted["evicted"] == conversation["id"] and evicted["freed_bytes"] > 0
    assert call(server, "GET", f"/admin/entries/{conversation['id']}")[0] == 404


def test_new_anchor_prefills_pins_and_the_next_session_hits_it(server: PatchedServer) -> None:
    system = "You are the anchor route assistant. " * 8
    status, _, body = call(server, "POST", "/admin/anchors", {"system": system})
    assert status == 200 and body["created"] is True and body["anchor"]["pinned"] is True
    again = call(server, "POST", "/admin/anchors", {"system": system})[2]
    assert again["created"] is False and again["anchor"]["id"] == body["anchor"]["id"]
    seq = max(r["seq"] for r in call(server, "GET", "/admin/requests")[2]["requests"])
    assert chat(server, "a new session", system=system)[0] == 200
    record = call(server, "GET", f"/admin/requests?since={seq}")[2]["requests"][-1]
    assert (record["restore_kind"], record["entry_id"]) == ("anchor", body["anchor"]["id"])
    # Unpinned by an operator, the same system prompt posted again pins it again, through the policy.
    anchor_id = body["anchor"]["id"]
    assert call(server, "POST", f"/admin/anchors/{anchor_id}/unpin")[2]["pinned"] is False
    repinned = call(server, "POST", "/admin/anchors", {"system": system})[2]
    assert repinned["created"] is False and repinned["anchor"]["pinned"] is True
    assert call(server, "GET", f"/admin/entries/{anchor_id}")[2]["pinned"] is True


@pytest.mark.parametrize("body", [{}, {"system": ""}, {"system": 3}, {"system": "x", "extra": 1},
                                  {"system": "x", "tools": "not a list"}, [], "text"])
def test_new_anchor_rejects_bad_bodies(server: PatchedServer, body: Any) -> None:
    status, _, answer = call(server, "POST", "/admin/anchors", body)
    assert status == 422 and "detail" in answer


def test_new_anchor_rejects_a_body_that_is_not_json(server: PatchedServer) -> None:
    status, _, answer = call(server, "POST", "/admin/anchors", raw=b"{not json")
    assert status == 422 and "detail" in answer


def test_requests_since_and_limits(server: PatchedServer) -> None:
    records = call(server, "GET", "/admin/requests")[2]["requests"]
    assert [r["seq"] for r in records] == sorted(r["seq"] for r in records)
    assert set(records[0]) >= {"seq", "restore_kind", "restored_tokens", "lookup_ms", "admission_ms", "prefill_ms",
                               "commit_ms", "ttft_ms", "entry_id", "prompt_tokens"}
    newest = records[-1]["seq"]
    assert call(server, "GET", f"/admin/requests?since={newest}")[2] == {"requests": []}
    assert len(call(server, "GET", "/admin/requests?limit=1")[2]["requests"]) == 1
    for query in ("since=-1", "limit=0", "limit=5001", "since=abc"):
        assert call(server, "GET", f"/admin/requests?{query}")[0] == 422, query


def test_events_stream_replays_cache_events_and_requests(server: PatchedServer) -> None:
    request = urllib.request.Request(server.base_url + "/admin/events?since=0",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    seen: dict[str, dict[str, Any]] = {}
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        name = None
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:") and name:
                seen.setdefault(name, json.loads(line[5:]))
            if {"cache", "request"} <= set(seen):
                break
    assert seen["cache"]["type"] == "cache" and seen["cache"]["event"]
    assert "restore_kind" in seen["request"]
    assert call(server, "GET", "/admin/events?since=-5")[0] == 422


def test_metrics_are_prometheus_text(server: PatchedServer) -> None:
    status, headers, text = call(server, "GET", "/admin/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert "# TYPE" in text and "apc" in text


def test_flush_writes_dirty_entries(server: PatchedServer) -> None:
    assert chat(server, "something new to write")[0] == 200
    status, _, body = call(server, "POST", "/admin/flush", {"timeout": 30})
    assert status == 200 and body["complete"] is True and body["queued"] >= 1


def test_flush_rejects_bad_bodies(server: PatchedServer) -> None:
    for body in ({"timeout": 0}, {"timeout": -1}, {"timeout": "soon"}, {"other": 1}):
        assert call(server, "POST", "/admin/flush", body)[0] == 422, body


def test_drain_turns_inference_away_and_undrain_admits_it(server: PatchedServer) -> None:
    for body in ({"retry_after": 0}, {"retry_after": 99999}, {"retry_after": "x"}, {"x": 1}):
        assert call(server, "POST", "/admin/drain", body)[0] == 422, body
    try:
        status, _, body = call(server, "POST", "/admin/drain", {"retry_after": 7})
        assert status == 200 and body["draining"] is True and body["retry_after_s"] == 7
        status, headers, answer = chat(server, "while draining")
        assert status == 503 and headers["retry-after"] == "7"
        assert answer["error"]["type"] == "server_draining"
        assert call(server, "GET", "/health", token=None)[0] == 200
        assert call(server, "GET", "/admin/status")[2]["idle"]["rejected_while_draining"] >= 1
    finally:
        status, _, body = call(server, "POST", "/admin/undrain")
    assert status == 200 and body["draining"] is False
    assert chat(server, "after draining")[0] == 200


def test_openapi_lists_only_admin_routes(server: PatchedServer) -> None:
    status, _, schema = call(server, "GET", "/admin/openapi.json")
    assert status == 200 and schema["paths"]
    assert all(path.startswith("/admin") for path in schema["paths"])
    assert {"/admin/status", "/admin/drain", "/admin/anchors"} <= set(schema["paths"])


def test_unknown_admin_path_is_a_json_404(server: PatchedServer) -> None:
    status, _, body = call(server, "GET", "/admin/nothing-here")
    assert status == 404 and "detail" in body
