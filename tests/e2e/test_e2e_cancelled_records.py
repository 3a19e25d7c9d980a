"""Every request gets a record: one cancelled in prefill is in /admin/requests and the journal.

A streamed request with a long new suffix whose client goes away while it is prefilled (a
client read timeout shorter than the prefill) used to be counted in ``status`` but missing
from ``/admin/requests`` and the journal (a gap in the sequence numbers): its record was only
ever finished at its first token. The prefill runs in small chunks (``--prefill-step-size``:
mlx-vlm's CLI sets ``PREFILL_STEP_SIZE`` from it, 2,048 by default) so the cancel lands between
two of them; the client closes its socket once the server logged the prefill's start.

A request cancelled while still queued (inserted behind another's prefill, which the generator
finishes first) never reached a lookup; it gets a record too, and ``hits.requests`` counts it.
A decode-phase cancel's journal line (written at its first token) is followed by its outcome.
"""

from __future__ import annotations

import json
import socket

from apcctl.journal_report import read_journal, summarize
from tests.server_harness import HOST, PatchedServer, wait_for

LONG = " ".join(f"word{i % 97} item{i}" for i in range(400))  # 4,646 tokens: 19 chunks of STEP
STEP = ["--prefill-step-size", "256"]


def prefills_started(server: PatchedServer) -> int:
    """How many requests the generator took in (mlx-vlm logs this as each is inserted)."""
    return server.log_text().count("Prefill started")


def send_stream(server: PatchedServer, content: str) -> socket.socket:
    """Send a streamed chat request on a raw socket and wait until the generator took it in."""
    body = json.dumps({"model": str(server.model_dir), "messages": [{"role": "user", "content": content}],
                       "stream": True, "max_tokens": 8, "temperature": 0.0}).encode()
    started = prefills_started(server)
    sock = socket.create_connection((HOST, server.port), timeout=60)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{server.port}\r\n".encode()
                 + b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: prefills_started(server) > started, "the request taken in", server)
    return sock


def cancel_during_prefill(server: PatchedServer, content: str) -> None:
    """Send a streamed chat request on a raw socket, close it once its prefill has started."""
    send_stream(server, content).close()


def read_to_end(sock: socket.socket) -> bytes:
    """The rest of a streamed response (the server ends it with ``[DONE]``)."""
    got = b""
    with sock:
        while b"[DONE]" not in got:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    return got


def journal_lines(journal) -> list[dict]:
    return [json.loads(line) for path in sorted(journal.rglob("journal.jsonl*")) for line in path.read_text().splitlines()]


def records(server: PatchedServer) -> list[dict]:
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    return body["requests"]


def test_a_request_cancelled_in_prefill_has_a_record(tiny_model_dir, tmp_path):
    journal = tmp_path / "journal"
    env = {"APC_JOURNAL_DIR": str(journal)}
    with PatchedServer(tiny_model_dir, env=env, args=STEP, log_dir=tmp_path / "logs") as server:
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
    lines = journal_lines(journal)
    journaled = [line for line in lines if line.get("type") == "request"]
    assert sorted(line["seq"] for line in journaled) == [1, 2, 3, 4]
    assert [line["phase"] for line in journaled if line["outcome"] == "cancelled"] == ["prefill"]
    # The decode cancel's line (from its first token) is followed by its outcome, and the
    # report reads the two as one request.
    outcomes = [line for line in lines if line.get("type") == "request_outcome"]
    assert [(o["seq"], o["outcome"], o["phase"], o["stored"]) for o in outcomes] == [
        (decode[0]["seq"], "cancelled", "decode", "reply")]
    summary = summarize(read_journal(journal), since=0.0, until=float("inf"))["requests"]
    assert (summary["count"], summary["cancelled_in_prefill"], summary["cancelled_in_decode"]) == (4, 1, 1)


def test_a_request_cancelled_while_queued_has_a_record_and_is_counted(tiny_model_dir, tmp_path):
    journal = tmp_path / "journal"
    env = {"APC_JOURNAL_DIR": str(journal)}
    with PatchedServer(tiny_model_dir, env=env, args=STEP, log_dir=tmp_path / "logs") as server:
        server.chat([{"role": "user", "content": "Hello"}], max_tokens=2)
        busy = send_stream(server, LONG)  # its prefill holds the generator for many steps
        # Taken in behind it, so still queued (the generator prefills one batch at a time):
        # its client goes before its prefill (and lookup) starts.
        send_stream(server, "A short question").close()
        wait_for(lambda: any(r.get("outcome") == "cancelled" for r in records(server)),
                 "a cancelled record", server)
        assert b"[DONE]" in read_to_end(busy)
        wait_for(lambda: len(records(server)) == 3, "three records", server)
        got = sorted(records(server), key=lambda r: r["seq"])
        status, body = server.admin("GET", "/status")
        assert status == 200, body
    assert [r["seq"] for r in got] == [1, 2, 3]  # no gap
    queued = [r for r in got if r["outcome"] == "cancelled"]
    assert [(r["phase"], r["stored"], r["ttft_ms"]) for r in queued] == [("queued", "nothing", 0)]
    assert 0 < queued[0]["prompt_tokens"] < 100 and got[1]["prompt_tokens"] > 1000  # the short one, queued
    assert [r["outcome"] for r in got if r is not queued[0]] == ["", ""]  # the long one went on
    assert body["hits"]["requests"] == len(got) and body["hits"]["cancelled_queued"] == 1
    journaled = [line for line in journal_lines(journal) if line.get("type") == "request"]
    assert sorted(line["seq"] for line in journaled) == [1, 2, 3]
    assert [line["phase"] for line in journaled if line["outcome"] == "cancelled"] == ["queued"]
