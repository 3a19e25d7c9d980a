"""Issue 34 item 9: with API keys, ``/metrics`` showed every key's totals to any key holder.

mlx-vlm's JSON metrics (request counts, prompt and reply sizes, times) cover every request of
the server, so a key holder polling them learned what the other keys sent. With keys they are
now the admin token's: a key gets 403 JSON, no key 401, the admin token the full view. Real
server on the tiny model, two keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server_harness import ADMIN_TOKEN, PatchedServer

KEYS = ("metrics-key-a-3d1f", "metrics-key-b-8e2c")


@pytest.mark.server
def test_metrics_totals_are_the_admin_tokens_when_keys_are_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    with PatchedServer(tiny_model_dir, env={"APC_API_KEYS": ",".join(KEYS)}, log_dir=tmp_path) as server:
        status, body = server.request("POST", "/v1/chat/completions", {
            "model": str(tiny_model_dir), "max_tokens": 2, "temperature": 0.0,
            "messages": [{"role": "user", "content": "key a's private question"}]},
            headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert status == 200, body
        for path in ("/metrics", "/v1/metrics"):
            status, body = server.request("GET", path, headers={"Authorization": f"Bearer {KEYS[1]}"})
            assert status == 403 and "admin token" in body["detail"], (path, status, body)
            assert server.request("GET", path)[0] == 401
            status, body = server.request("GET", path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert status == 200 and body["summary"], (path, status, body)
