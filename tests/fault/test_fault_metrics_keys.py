"""Issue 34 item 9: with API keys, ``/metrics`` showed every key's totals to any key holder.

mlx-vlm's JSON metrics (request counts, prompt and reply sizes, times) cover every request of
the server, so a key holder polling them learned what the other keys sent. With keys they are
now the admin token's: a key gets 403 JSON, no key 401, the admin token the full view. Real
server on the tiny model: the package's ``keyed`` server (tests/fault/conftest.py).
"""

from __future__ import annotations

import pytest

from tests.fault.conftest import KEYS
from tests.server_harness import ADMIN_TOKEN, PatchedServer


@pytest.mark.server
def test_metrics_totals_are_the_admin_tokens_when_keys_are_on(keyed: PatchedServer) -> None:
    status, body = keyed.request("POST", "/v1/chat/completions", {
        "model": str(keyed.model_dir), "max_tokens": 2, "temperature": 0.0,
        "messages": [{"role": "user", "content": "key a's private question"}]},
        headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert status == 200, body
    for path in ("/metrics", "/v1/metrics"):
        status, body = keyed.request("GET", path, headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert status == 403 and "admin token" in body["detail"], (path, status, body)
        assert keyed.request("GET", path)[0] == 401
        status, body = keyed.request("GET", path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert status == 200 and body["summary"], (path, status, body)
