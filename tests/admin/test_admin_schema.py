"""The typed /admin answers (``server_patch.admin.schema``): what the server builds is what the
client parses, a changed answer is one clear error at the client, and a real server's every
/admin answer fits its type and comes back from it byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from apcctl.core.client import AdminClient, AnswerMismatch
from server_patch.admin import schema
from server_patch.admin.schema import SchemaError

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "You are the schema test assistant. " + "Answer in one short line and name the file. " * 6


def same_json(a: Any, b: Any) -> bool:
    """Equal keys, values and key order (what a script diffing ``--json`` output sees)."""
    return json.dumps(a) == json.dumps(b)


# ---------------------------------------------------------------------- without a server


def test_the_schema_loads_nothing_heavy() -> None:
    code = ("import sys; import server_patch.admin.schema; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'mlx', 'mlx_vlm', 'fastapi', 'httpx'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_request_record_has_the_timing_records_fields_in_order() -> None:
    from server_patch.integration.timings import RequestTiming

    assert schema.RequestRecord.json_keys() == tuple(RequestTiming(1, 0.0, 10).as_dict())


def test_the_views_round_trip_through_the_types() -> None:
    from server_patch.admin import views
    from server_patch.lineage import LineageCache, LineageConfig, SizedKV, SizedSnapshot

    cache = LineageCache(LineageConfig(periodic_stride=0))
    ids = list(range(1, 400))
    entry = cache.commit(ids, kv=SizedKV(10, len(ids) - 1), head=SizedSnapshot(100),
                         captures={200: ("guard", SizedSnapshot(100))})
    built = [views.entry_view(entry), views.entry_view(cache.pin(entry.id))]
    for view in built:
        raw = json.loads(json.dumps(view.to_json()))  # what goes over the wire
        parsed = schema.EntryInfo.from_json(raw)
        assert parsed == view and same_json(parsed.to_json(), raw)
        assert [c.kind for c in parsed.checkpoints] == ["guard"]
    assert built[1].is_anchor and built[1].kind == schema.EntryKind.ANCHOR and built[1].tier == schema.Residence.RAM
    budgets = views.configured_budgets(LineageConfig())
    assert same_json(schema.Budgets.from_json(cache.budgets()).to_json(), cache.budgets())
    assert list(budgets.to_json()) == list(cache.budgets())  # the configured budgets have the cache's shape


def test_a_renamed_field_is_one_clear_error_at_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    client = AdminClient("http://127.0.0.1:9", "token")
    entry = {"id": "abc", "kind": "anchor", "pinned": True, "length": 3, "bytes": 1, "kv_bytes": 1}
    renamed = {**entry, "ident": entry["id"]}
    del renamed["id"]
    answers = {"/admin/entries": {"entries": [renamed], "budgets": {}, "started": True},
               "/admin/status": {"srv": {"pid": 1}, "idle": {}}}
    monkeypatch.setattr(client, "_request", lambda method, path, *a, **k: answers[path])
    with pytest.raises(AnswerMismatch, match=r"/admin/entries\.entries\[0\]: missing field 'id'") as caught:
        client.entries()
    assert caught.value.status == 200 and "same version" in caught.value.message
    with pytest.raises(AnswerMismatch, match=r"/admin/status: missing field 'server'"):
        client.status()


def test_the_dashboard_says_a_changed_answer_as_a_poll_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from tui.source import LiveSource, SourceError
    from tui.state import DashboardState

    client = AdminClient("http://127.0.0.1:9", "token")
    monkeypatch.setattr(client, "_request", lambda *a, **k: {"server": {"process_id": 7}, "idle": {}})
    state = DashboardState()
    with pytest.raises(SourceError) as caught:
        LiveSource(client).snapshot()
    state.poll_failed(str(caught.value))
    assert "/admin/status.server: missing field 'pid'" in state.connection.error


def test_a_newer_servers_extra_fields_and_values_are_kept() -> None:
    raw = {"seq": 4, "started": 1.0, "prompt_tokens": 9, "restore_kind": "teleport", "future_field": [1, 2]}
    record = schema.RequestRecord.from_json(raw)
    assert record.restore_kind == "teleport" and record["future_field"] == [1, 2]
    assert record.to_json()["future_field"] == [1, 2]
    with pytest.raises(SchemaError, match="expected an object"):
        schema.Status.from_json([])
    with pytest.raises(SchemaError, match=r"/admin/requests\.requests: expected a list"):
        schema.Requests.from_json({"requests": {}})


# ---------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from tests.server_harness import PatchedServer

    with PatchedServer(tiny_model_dir, log_dir=tmp_path_factory.mktemp("admin-schema")) as running:
        yield running


def answer(server: Any, kind: type[schema.Answer], method: str, path: str, body: Any = None) -> Any:
    """``path``'s raw answer parsed as ``kind``; its JSON must be the raw answer exactly."""
    status, raw = server.admin(method, path, body)
    assert status == 200, (path, raw)
    parsed = kind.from_json(raw)
    assert same_json(parsed.to_json(), raw), (path, parsed.to_json(), raw)
    assert not unknown(parsed), f"{path}: fields the server sends and the schema lacks: {unknown(parsed)}"
    return parsed


def unknown(value: Any, where: str = "") -> list[str]:
    """Fields of ``value`` (an answer, nested ones included) that its type does not name."""
    if isinstance(value, list):
        return [u for i, v in enumerate(value) for u in unknown(v, f"{where}[{i}]")]
    if not isinstance(value, schema.Answer):
        return []
    found = [f"{where}.{key}" for key in getattr(value, "_extra", {})]
    for key in value.json_keys():
        found += unknown(value.get(key), f"{where}.{key}")
    return found


@pytest.mark.server
def test_every_admin_answer_of_a_real_server_fits_its_type(server: Any) -> None:
    before = answer(server, schema.Status, "GET", "/status")
    assert before.server.pid == server.pid and before.sizing is not None
    assert answer(server, schema.Entries, "GET", "/entries").started is False  # no cache before the first request
    for user in ("hello", "and again"):
        server.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], max_tokens=2)
    status = answer(server, schema.Status, "GET", "/status")
    assert status.lineage is not None and status.hits.requests == 2
    listed = answer(server, schema.Entries, "GET", "/entries")
    conversation = next(e for e in listed.entries if e.kind == schema.EntryKind.CONVERSATION)
    assert answer(server, schema.EntryInfo, "GET", f"/entries/{conversation.id}") == conversation
    records = answer(server, schema.Requests, "GET", "/requests").requests
    assert [r.seq for r in records] == [1, 2] and records[1].restored_tokens > 0
    answer(server, schema.Anchors, "GET", "/anchors")
    assert answer(server, schema.EntryInfo, "POST", f"/anchors/{conversation.id}/pin").pinned
    assert not answer(server, schema.EntryInfo, "POST", f"/anchors/{conversation.id}/unpin").pinned
    made = answer(server, schema.NewAnchor, "POST", "/anchors", {"system": "You are a terse schema probe."})
    assert made.created and made.anchor.is_anchor
    answer(server, schema.FlushReport, "POST", "/flush", {"timeout": 30})
    assert answer(server, schema.Traffic, "POST", "/drain", {"retry_after": 2}).draining
    assert not answer(server, schema.Traffic, "POST", "/undrain").draining
    answer(server, schema.CanaryState, "GET", "/verify")
    answer(server, schema.Cleared, "POST", "/verify/clear", {})
    answer(server, schema.ModelInfo, "GET", "/model")
    assert answer(server, schema.Evicted, "DELETE", f"/entries/{made.anchor.id}").evicted == made.anchor.id


@pytest.mark.server
def test_the_client_returns_the_types(server: Any) -> None:
    from tests.server_harness import ADMIN_TOKEN

    client = AdminClient(server.base_url, ADMIN_TOKEN)
    status = client.status()
    assert isinstance(status, schema.Status) and status.server.pid == server.pid
    assert status["server"]["pid"] == status.server.pid  # the objects still read as their JSON
    assert all(isinstance(e, schema.EntryInfo) for e in client.entries())
    assert all(isinstance(r, schema.RequestRecord) for r in client.requests())
    assert isinstance(client.model(), schema.ModelInfo) and isinstance(client.canary(), schema.CanaryState)
