"""Issue 34 item 15: one slow streaming client vetoed ``apcctl restart``.

A client streaming ``max_tokens`` 100000 and reading 64 bytes every half second kept its
request in flight for hours: the drain waited its whole timeout (503 for everyone) and failed.
Now a request still in flight ``APC_DRAIN_STREAM_DEADLINE_S`` after the drain began is ended:
a reader that keeps up gets a final SSE error (``drain_deadline``) and ``[DONE]``, the slow
reader's connection is closed, their rows are cancelled, the drain completes and SIGTERM exits
without SIGKILL. Real server, a real slow socket client, the drain through ``/admin/drain``.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
from pathlib import Path

import pytest

from tests.fault.test_fault_client_gone import long_request, queued_ids
from tests.server_harness import HOST, PatchedServer, wait_for

pytestmark = pytest.mark.server


class SlowReader(threading.Thread):
    """Streams a chat and reads 64 bytes every half second, as the issue's client did, until told
    to hurry (then it reads what is left at once, to see how its stream ended)."""

    def __init__(self, server: PatchedServer, payload: dict) -> None:
        super().__init__(daemon=True)
        self.server, self.payload = server, payload
        self.received = b""
        self.ended = threading.Event()
        self.hurry = threading.Event()
        self.reset = False

    def run(self) -> None:
        body = json.dumps(self.payload).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its window fills fast
        try:
            sock.connect((HOST, self.server.port))
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{self.server.port}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            while True:
                chunk = sock.recv(64 if not self.hurry.is_set() else 1 << 16)
                if not chunk:
                    break
                self.received += chunk
                self.hurry.wait(0.5)  # the client's pace, not a synchronisation
        except OSError:
            self.reset = True  # the server aborted the connection
        finally:
            sock.close()
            self.ended.set()


def read_stream(server: PatchedServer, payload: dict, lines: list[str], started: threading.Event) -> None:
    """A client that keeps up: every SSE data line, until the stream ends."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    for raw in response:
        text = raw.decode("utf-8", "replace").strip()
        if text.startswith("data:"):
            lines.append(text[5:].strip())
            started.set()
    conn.close()


def status(server: PatchedServer) -> dict:
    code, body = server.admin("GET", "/status")
    assert code == 200, body
    return body["idle"] if "idle" in body else body["traffic"]


def test_a_slow_stream_no_longer_vetoes_a_drain(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = PatchedServer(tiny_model_dir, env={"APC_DRAIN_STREAM_DEADLINE_S": "3"}, log_dir=tmp_path).start()
    try:
        payload = {**long_request(server, 5, max_tokens=100_000), "stream": True}
        slow = SlowReader(server, payload)
        slow.start()
        wait_for(lambda: len(slow.received) > 0, "the slow client's first bytes", server)
        lines: list[str] = []
        started = threading.Event()
        fast = threading.Thread(target=read_stream, args=(server, {**long_request(server, 6, max_tokens=100_000),
                                                                   "stream": True}, lines, started), daemon=True)
        fast.start()
        wait_for(started.is_set, "the second stream's first tokens", server)
        assert status(server)["in_flight"] == 2

        code, body = server.admin("POST", "/drain", {"retry_after": 1})
        assert code == 200 and body["draining"], body
        assert server.request("POST", "/v1/chat/completions", long_request(server, 7, max_tokens=2))[0] == 503

        # Before the fix nothing ever ended either stream: this wait only bounds a hang.
        wait_for(lambda: status(server)["in_flight"] == 0, "the drain's end", server, timeout=120)
        fast.join(timeout=60)
        assert not fast.is_alive()
        assert lines[-1] == "[DONE]", lines[-3:]
        final = json.loads(lines[-2])
        assert final["error"]["code"] == "drain_deadline" and final["error"]["type"] == "server_draining", final
        ids = queued_ids(server)
        wait_for(lambda: all(f"Generation cancelled: request={rid}" in server.log_text() for rid in ids[:2]),
                 "both rows' cancellation", server)
        assert "still in flight 3 s into the drain: ended" in server.log_text()

        assert server.admin("POST", "/undrain")[0] == 200
        assert server.chat([{"role": "user", "content": "next"}], max_tokens=2)["choices"]
    finally:
        code = server.stop(timeout=60)  # the slow client is still reading at its pace
        slow.hurry.set()
    assert code in (0, -signal.SIGTERM), server.log_tail()  # not -9: no connection held the shutdown
    slow.join(timeout=60)
    assert slow.ended.is_set()
    # Its stream ended with the final words, or (when its socket could not take them) was aborted.
    tail = slow.received[slow.received.rfind(b"drain_deadline"):]
    assert slow.reset or b"drain_deadline" in tail and tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), \
        slow.received[-300:]  # the last chunk, then chunked encoding's end


@pytest.mark.parametrize("send_blocks", [False, True])
def test_a_connection_that_cannot_take_the_final_words_is_aborted(monkeypatch: pytest.MonkeyPatch,
                                                                   send_blocks: bool) -> None:
    """The slow reader's path, on a real TCP connection whose client reads nothing: bytes wait in
    the server's write buffer (uvicorn's shutdown would wait for them), or the final send cannot
    complete; either way the connection is aborted, found by the client's address."""
    import asyncio

    from server_patch.infra import drain_deadline

    monkeypatch.setattr(drain_deadline, "FINAL_WRITE_S", 0.2)

    async def scenario() -> tuple[bool, bool]:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(lambda r, w: accepted.set_result(w), HOST, 0)
        client = socket.create_connection(server.sockets[0].getsockname()[:2])
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer = await accepted
        transport = writer.transport
        while transport.get_write_buffer_size() == 0:  # the client reads nothing: the kernel fills, then ours
            transport.write(b"x" * (1 << 20))
            await asyncio.sleep(0)
        scope = {"client": client.getsockname()[:2], "server": server.sockets[0].getsockname()[:2],
                 "method": "POST", "path": "/v1/chat/completions"}
        state = drain_deadline.ResponseState()
        state.saw({"type": "http.response.start", "headers": [(b"content-type", b"text/event-stream")]})

        async def send(message: dict) -> None:
            if send_blocks:
                await asyncio.Event().wait()  # a send that never gets room
            transport.write(message.get("body", b""))

        await drain_deadline.end(scope, send, state, 3.0)
        aborted = transport.is_closing()
        server.close()
        client.close()
        return aborted, transport.get_write_buffer_size() == 0

    aborted, emptied = asyncio.run(scenario())
    assert aborted and emptied  # abort drops what the client would never have read
