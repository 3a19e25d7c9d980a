"""Waits for another request's work, on the real patched server (issue 29): a stream decoding
while another session's cold prompt prefills ends with that prefill on its record, by kind, in
``/admin/requests``, the event stream's ``request_ended`` and ``/admin/metrics``; the prefilling
request's own chunks are not charged to itself. Presence, kind and which record, never a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apcctl.core.client import AdminClient
from server_patch.admin.schema import RequestRecord
from tests.integration.test_pacing import Stream
from tests.server_harness import ADMIN_TOKEN, PatchedServer, text, wait_for


def records(server: PatchedServer) -> list[RequestRecord]:
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    return [RequestRecord.from_json(r) for r in body["requests"]]


def decoded_beside(server: PatchedServer, other: list[dict], tenant: str, *, max_tokens: int) -> Stream:
    """A stream of ``max_tokens`` that decodes while ``other`` (4 tokens, ``tenant``) is served,
    both rows ended on the server: the stream's record then holds what it waited for."""
    stream = Stream(server, max_tokens=max_tokens)
    stream.start()
    assert stream.decoding.wait(120)
    server.chat(other, tenant=tenant, max_tokens=4)
    stream.join(300)
    assert not stream.is_alive() and stream.tokens > 3
    wait_for(lambda: len(records(server)) == 2 and all(r.ended for r in records(server)),
             "both rows ended", server)
    return stream


def _ended_events(server: PatchedServer, seq: int) -> RequestRecord:
    """The event stream's ``request_ended`` of record ``seq`` (replayed on connecting)."""
    for name, data in AdminClient(server.base_url, ADMIN_TOKEN).events(timeout=60):
        if name == "request_ended" and data["seq"] == seq:
            return RequestRecord.from_json(data)
    raise AssertionError("no request_ended event")


def _waited_sum(server: PatchedServer, work: str) -> float:
    status, body = server.admin("GET", "/metrics")
    assert status == 200
    line = next(line for line in body.splitlines()
                if line.startswith("apc_request_waited_seconds_sum") and f'work="{work}"' in line)
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.server
def test_a_decoding_stream_waits_for_another_requests_cold_prefill(tiny_model_dir: Path, tmp_path: Path) -> None:
    with PatchedServer(tiny_model_dir, log_dir=tmp_path) as server:
        cold = [{"role": "system", "content": text(40, 2911)}, {"role": "user", "content": text(1500, 2912)}]
        decoded_beside(server, cold, "cold", max_tokens=600)
        streaming, prefilled = sorted(records(server), key=lambda r: r.prompt_tokens)
        # The stream was decoding through the other's prefill chunks: charged to it, as prefill,
        # and its decode steps were pushed back.
        assert streaming.waited.get("prefill", 0) > 0, streaming
        assert streaming.delayed_steps > 0 and streaming.waited_ms >= streaming.waited["prefill"]
        # The prefilling request's own chunks are not its wait (nobody else prefilled meanwhile).
        assert prefilled.waited.get("prefill", 0) == 0, prefilled

        # The final record reached the event stream, after the first-token one, and the histogram.
        final = _ended_events(server, streaming.seq)
        assert final.ended and final.waited == streaming.waited
        assert _waited_sum(server, "prefill") > 0
