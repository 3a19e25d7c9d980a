"""Issue 34 item 8: with API keys, one key read another's stored Responses and continued them.

mlx-vlm keeps stored Responses in one process-wide dict; now each is visible only to the
namespace (key, tenant, salt) that stored it, and a foreign id answers exactly as an unknown
one. Real server on the tiny model with two keys, over HTTP; streamed responses included (the
namespace must reach the stream's generator).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from server_patch.tenancy.responses import CURRENT, NamespacedResponses
from tests.fault.conftest import KEYS
from tests.server_harness import PatchedServer

UNKNOWN = "resp_0123456789abcdef0123456789abcdef"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _create(server: PatchedServer, key: str, **fields: Any) -> tuple[int, Any]:
    body = {"model": str(server.model_dir), "input": "Say something short.", "max_output_tokens": 2,
            "temperature": 0.0, **fields}
    return server.request("POST", "/v1/responses", body, headers=_bearer(key))


def _streamed_id(server: PatchedServer, key: str) -> str:
    """Create a response with ``stream: true``; the id from its ``response.completed`` event."""
    status, text = _create(server, key, stream=True)
    assert status == 200, text
    events = [json.loads(line[5:]) for line in str(text).splitlines() if line.startswith("data:")
              and line[5:].strip() not in ("", "[DONE]")]
    (done,) = [e for e in events if e.get("type") in ("response.completed", "response.incomplete")]
    return done["response"]["id"]


@pytest.mark.server
def test_a_key_sees_only_its_own_responses(keyed: PatchedServer) -> None:
    owner, other = KEYS[:2]
    status, created = _create(keyed, owner)
    assert status == 200, created
    ids = [created["id"], _streamed_id(keyed, owner)]
    for rid in ids:
        for suffix in ("", "/input_items"):
            mine = keyed.request("GET", f"/v1/responses/{rid}{suffix}", headers=_bearer(owner))
            assert mine[0] == 200, mine
            foreign = keyed.request("GET", f"/v1/responses/{rid}{suffix}", headers=_bearer(other))
            unknown = keyed.request("GET", f"/v1/responses/{UNKNOWN}{suffix}", headers=_bearer(other))
            assert foreign[0] == 404 and foreign == unknown, (foreign, unknown)

    rid = ids[0]
    foreign = _create(keyed, other, previous_response_id=rid)
    unknown = _create(keyed, other, previous_response_id=UNKNOWN)
    assert foreign[0] == 404 and json.dumps(foreign[1]).replace(rid, UNKNOWN) == json.dumps(unknown[1]), \
        (foreign, unknown)
    for method, suffix in (("POST", "/cancel"), ("DELETE", "")):
        foreign = keyed.request(method, f"/v1/responses/{rid}{suffix}", headers=_bearer(other))
        unknown = keyed.request(method, f"/v1/responses/{UNKNOWN}{suffix}", headers=_bearer(other))
        assert foreign[0] == 404 and foreign == unknown, (foreign, unknown)
    assert keyed.request("GET", f"/v1/responses/{rid}", headers=_bearer(owner))[0] == 200  # not deleted

    status, continued = _create(keyed, owner, previous_response_id=rid)
    assert status == 200 and continued["previous_response_id"] == rid, continued


def test_the_size_limit_evicts_across_namespaces() -> None:
    """mlx-vlm drops the oldest response when its store is full, whoever stored it."""
    store = NamespacedResponses()
    token = CURRENT.set("ns-a")
    store["r1"] = "a's"
    CURRENT.reset(token)
    token = CURRENT.set("ns-b")
    try:
        assert store.get("r1") is None and "r1" not in store and store.pop("r1", None) is None
        store.evict("r1")
        store["r2"] = "b's"
        assert store.get("r2") == "b's" and list(dict.keys(store)) == ["r2"]
    finally:
        CURRENT.reset(token)
