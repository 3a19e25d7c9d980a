"""A client that leaves stops its row (issue 23, item 10), on the real patched server.

Stock decoded a non-streamed request to ``max_tokens`` after its client had gone, and a SIGTERM
then waited on it until SIGKILL, so the shutdown flush never ran. The proof is the server's
own record: mlx-vlm's ``Generation cancelled: request=<id> generated_tokens=<n>`` line for that
request, with ``n`` far below ``max_tokens`` (no end-of-sequence token can end it early).
"""

from __future__ import annotations

import http.client
import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import HOST, PatchedServer, text, wait_for

MAX_TOKENS = 200_000


def long_request(server: PatchedServer, seed: int, **fields: Any) -> dict[str, Any]:
    """A greedy chat that can only end at ``max_tokens``: every end-of-sequence id is biased away."""
    eos = json.loads((server.model_dir / "config.json").read_text())["eos_token_id"]
    return {"model": str(server.model_dir), "temperature": 0.0, "max_tokens": MAX_TOKENS,
            "logit_bias": {str(t): -100 for t in eos},
            "messages": [{"role": "system", "content": text(200, 1)}, {"role": "user", "content": text(40, seed)}],
            **fields}


def queued_ids(server: PatchedServer) -> list[str]:
    return re.findall(r"Generation queued: request=(\w+)", server.log_text())


def progress(server: PatchedServer, request_id: str) -> int:
    """The most tokens a ``Decode progress`` line reported for ``request_id`` (0: none yet)."""
    counts = re.findall(rf"Decode progress: request={request_id} generated_tokens=(\d+)", server.log_text())
    return max(map(int, counts), default=0)


def cancelled(server: PatchedServer, request_id: str) -> int | None:
    """``generated_tokens`` of the request's ``Generation cancelled`` line, or None."""
    match = re.search(rf"Generation cancelled: request={request_id} generated_tokens=(\d+)", server.log_text())
    return int(match.group(1)) if match else None


def send_and_leave(server: PatchedServer, payload: dict[str, Any]) -> str:
    """POST ``payload`` (not streamed), wait until it decodes, then drop the connection unread."""
    known = len(queued_ids(server))
    conn = http.client.HTTPConnection(HOST, server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                 headers={"Content-Type": "application/json"})
    wait_for(lambda: len(queued_ids(server)) > known, "the request's queueing", server)
    request_id = queued_ids(server)[known]
    wait_for(lambda: progress(server, request_id) > 0, "the request's first decode steps", server)
    assert conn.sock is not None
    conn.sock.close()  # the client is gone, its response unread
    conn.close()
    return request_id


@pytest.mark.server
def test_a_non_streamed_request_whose_client_left_stops_and_sigterm_flushes(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    server = PatchedServer(tiny_model_dir, log_dir=tmp_path).start()
    try:
        # An anchor's in-process prefill has no client: its ASGI receive says "disconnect" at once.
        status, body = server.admin("POST", "/anchors", {"system": text(300, 9)})
        assert status == 200 and "Generation cancelled" not in server.log_text(), (status, body)

        streamed = len(queued_ids(server))
        server.stream_and_drop(long_request(server, 3)["messages"], chunks=3, max_tokens=MAX_TOKENS,
                               logit_bias=long_request(server, 3)["logit_bias"])
        stream_id = queued_ids(server)[streamed]
        wait_for(lambda: cancelled(server, stream_id) is not None, "the stream's cancellation", server)

        request_id = send_and_leave(server, long_request(server, 2))
        wait_for(lambda: cancelled(server, request_id) is not None, "the cancellation", server)
        assert cancelled(server, request_id) < MAX_TOKENS // 10, server.log_tail()
        assert server.chat([{"role": "user", "content": "next"}], max_tokens=2)["choices"]  # the GPU is free
        held = {entry["id"] for entry in server.admin("GET", "/entries?tier=ram")[1]["entries"]}
    finally:
        code = server.stop(timeout=30)
    assert code in (0, -signal.SIGTERM), server.log_tail()  # not -9: no SIGKILL was needed
    assert "Application shutdown complete" in server.log_text()
    on_disk = {path.stem for path in (tmp_path / "lineage-disk").rglob("*.safetensors")}
    assert len(held) >= 3 and held <= on_disk, (held, on_disk)  # the anchor and both conversations: flushed


@pytest.mark.server
def test_with_cancel_on_disconnect_off_a_request_decodes_on_as_stock(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = PatchedServer(tiny_model_dir, env={"APC_CANCEL_ON_DISCONNECT": "0"}, log_dir=tmp_path).start()
    try:
        request_id = send_and_leave(server, long_request(server, 4))
        left_at = progress(server, request_id)
        wait_for(lambda: progress(server, request_id) > left_at + 100, "decoding past the disconnect", server)
        assert cancelled(server, request_id) is None
    finally:
        server.process.kill()  # stock behaviour would hold a SIGTERM until the 200k tokens are done
        server.process.wait(timeout=30)
