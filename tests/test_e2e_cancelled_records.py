"""Every request gets a record: one cancelled in prefill is in /admin/requests and the journal.

A streamed request with a long new suffix whose client goes away while it is prefilled (a
client read timeout shorter than the prefill) used to be counted in ``status`` but missing
from ``/admin/requests`` and the journal (a gap in the sequence numbers): its record was only
ever finished at its first token. The prefill runs in small steps (``PREFILL_STEP_SIZE``) so
the cancel lands between two of them; the client closes its socket once the server logged the
prefill's start.
"""

from __future__ import annotations

import json
import socket
import time

from server_harness import HOST, PatchedServer, wait_for

LONG = " ".join(f"word{i % 97} item{i}" for i in range(1500))


def cancel_during_prefill(server: PatchedServer, content: str) -> None:
    """Send a streamed chat request on a raw socket, close it once its prefill has started."""
    body = json.dumps({"model": str(server.model_dir), "messages": [{"role": "user", "content": content}],
                       "stream": True, "max_tokens": 8, "temperature": 0.0}).encode()
    started = server.log_text().count("Prefill started")
    sock = socket.create_connection((HOST, server.port), timeout=30)
    try:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{server.port}\r\n".encode()
                     + b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 60
        while server.log_text().count("Prefill started") == started and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sock.close()


def records(server: PatchedServer) -> list[dict]:
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    return body["requests"]


def test_a_request_cancelled_in_prefill_has_a_record(tiny_model_dir, tmp_path):
    journal = tmp_path / "journal"
    env = {"PREFILL_STEP_SIZE": "16", "APC_JOURNAL_DIR": str(journal)}
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "logs") as server:
        server.chat([{"role": "user", "content": "Hello"}], max_tokens=2)
        cancel_during_prefill(server, LONG)
        wait_for(lambda: any(r.get("outcome") == "cancelled" for r in records(server)),
                 "a cancelled record", server)
        server.chat([{"role": "user", "content": "Hello again"}], max_tokens=2)
        wait_for(lambda: len(records(server)) == 3, "three records", server)
        got = records(server)
        cancelled = [r for r in got if r["outcome"] == "cancelled"]
        assert [(r["phase"], r["stored"]) for r in cancelled] == [("prefill", "nothing")]
        assert cancelled[0]["prompt_tokens"] > 1000 and cancelled[0]["ttft_ms"] == 0
        assert sorted(r["seq"] for r in got) == [1, 2, 3]  # no gap
        assert [r["outcome"] for r in sorted(got, key=lambda r: r["seq"])] == ["", "cancelled", ""]
        # Cancelled while decoding: the record (finished at the first token) says so too, and
        # that the entry kept the reply streamed so far.
        server.stream_and_drop([{"role": "user", "content": "Tell me a long story"}], chunks=2, max_tokens=200)
        wait_for(lambda: sum(r.get("outcome") == "cancelled" for r in records(server)) == 2,
                 "a cancelled-in-decode record", server)
        decode = [r for r in records(server) if r["outcome"] == "cancelled" and r["phase"] == "decode"]
        assert len(decode) == 1 and decode[0]["stored"] == "reply" and decode[0]["reply_tokens"] > 0
    lines = [json.loads(line) for path in sorted(journal.rglob("journal.jsonl*")) for line in path.read_text().splitlines()]
    journaled = [line for line in lines if line.get("type") == "request"]
    assert sorted(line["seq"] for line in journaled) == [1, 2, 3, 4]
    assert [line["phase"] for line in journaled if line["outcome"] == "cancelled"] == ["prefill"]
