"""A drain that can finish: requests still in flight ``APC_DRAIN_STREAM_DEADLINE_S`` after a drain
began are ended by the server.

A restart drains (new requests get 503) and waits until nothing is in flight. One client that
streams ``max_tokens`` 100000 and reads 64 bytes every half second kept its request in flight
for hours, so every drain failed after its timeout with everyone refused meanwhile. Past the
deadline, :func:`end` closes the request: the app sees its client gone (the stream's row is
cancelled at the next step, as for a real disconnect) and is cancelled, and the client gets
final words where it can: a 503 JSON error when nothing was sent yet, or a last SSE event
``{"error": {"type": "server_draining", "code": "drain_deadline"}}`` then ``data: [DONE]`` on an
event stream. A client that does not take them within ``FINAL_WRITE_S`` (its socket is full: it
is the slow reader) has its connection aborted, as does any connection still holding unsent
bytes: uvicorn's graceful shutdown would otherwise wait for them to drain, at the slow reader's
pace, and the restart's stop would end in SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from server_patch import clock, settings
from server_patch.infra.asgi import Message, Scope, Send

ENV = "APC_DRAIN_STREAM_DEADLINE_S"
POLL_S = 0.5  # how often an in-flight request looks at the drain (only while it is in flight)
FINAL_WRITE_S = 2.0  # how long the final words may take to reach a client's socket
CUT_MESSAGE = "server is restarting: this reply was ended at the drain deadline ({:.0f} s); retry"

log = logging.getLogger("server_patch.drain")


def deadline_s() -> float | None:
    """The setting in force; None (0 or less) keeps waiting for every request, as before."""
    value = float(settings.value(ENV))
    return value if value > 0 else None


async def passed(cut_at: Callable[[], float | None]) -> None:
    """Return once ``cut_at()`` (a monotonic time, None while no drain runs) has passed."""
    while True:
        at = cut_at()
        now = clock.monotonic()
        if at is not None and now >= at:
            return
        await asyncio.sleep(POLL_S if at is None else min(POLL_S, at - now))


def _sse(message: Message) -> bool:
    headers: dict[bytes, bytes] = dict(message.get("headers") or [])
    return headers.get(b"content-type", b"").split(b";")[0].strip().lower() == b"text/event-stream"


class ResponseState:
    """What the app sent so far: whether the response started, as an event stream, and ended."""

    def __init__(self) -> None:
        self.started = False
        self.event_stream = False
        self.finished = False

    def saw(self, message: Message) -> None:
        if message.get("type") == "http.response.start":
            self.started, self.event_stream = True, _sse(message)
        elif message.get("type") == "http.response.body" and not message.get("more_body", False):
            self.finished = True


async def end(scope: Scope, send: Send, state: ResponseState, deadline: float) -> None:
    """Send the final words (bounded by ``FINAL_WRITE_S``), then abort a connection that cannot
    take them or still holds unsent bytes."""
    text = CUT_MESSAGE.format(deadline)
    error = {"error": {"message": text, "type": "server_draining", "code": "drain_deadline"}}
    messages: list[dict[str, Any]] = []
    if not state.started:
        body = json.dumps(error).encode()
        messages = [{"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]},
            {"type": "http.response.body", "body": body}]
    elif state.event_stream:
        messages = [{"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()}]
    delivered = bool(messages)
    try:
        for message in messages:
            await asyncio.wait_for(send(message), FINAL_WRITE_S)
    except (asyncio.TimeoutError, OSError, RuntimeError):
        delivered = False
    log.warning("apc drain: %s %s still in flight %.0f s into the drain: ended%s", scope.get("method"),
                scope.get("path"), deadline, "" if delivered else " (connection aborted)")
    abort_if_backed_up(scope, force=not delivered)


def abort_if_backed_up(scope: Scope, *, force: bool) -> None:
    """Abort the request's connection when ``force``, or when bytes wait in its write buffer.

    ASGI offers no abort, so the transport is found by the client's address among the event
    loop's transports (CPython's selector loop keeps them in ``_transports``). Where it cannot
    be found (another loop), the connection closes when its client reads or leaves.
    """
    client, server = scope.get("client"), scope.get("server")
    transports = getattr(asyncio.get_running_loop(), "_transports", None)
    if not client or transports is None:
        return
    for transport in list(transports.values()):
        try:
            peer, own = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
            if not peer or tuple(peer[:2]) != tuple(client[:2]) or (server and tuple(own[:2]) != tuple(server[:2])):
                continue
            if force or transport.get_write_buffer_size() > 0:
                transport.abort()
        except (AttributeError, OSError, TypeError, IndexError):
            continue


__all__ = ["ENV", "ResponseState", "abort_if_backed_up", "deadline_s", "end", "passed"]
