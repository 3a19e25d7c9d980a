"""The Host/Origin guard in front of smg: the gateway's public port is this, smg listens behind it.

smg 1.13.0 answers any ``Host`` (a web page that re-resolves its own name to 127.0.0.1, DNS
rebinding, becomes the gateway's origin) and has no option to refuse one; it also replaces
``Host`` with the worker's and drops ``Origin`` when it forwards a request, so the servers' own
guard (``server_patch.serving.origins``) never sees what the browser sent. This guard applies the
servers' rules (the same ``OriginPolicy``: ``APC_ALLOWED_HOSTS`` / ``APC_ALLOWED_ORIGINS``) before
a byte reaches smg: a foreign ``Host`` or a cross-origin ``Origin`` gets 403 JSON on every route,
the control plane included.

It reads only the request head and then copies bytes both ways (streams pass through untouched).
Each connection carries one request: the head goes on with ``Connection: close``, so smg answers
it and closes, and nothing after the first request on a connection (a pipelined or smuggled
second head) is ever read without a check. Clients reconnect per request; keep-alive is lost.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from dataclasses import dataclass

from server_patch.serving.origins import OriginPolicy

MAX_HEAD_BYTES = 64 * 1024  # a request head larger than this is refused (431)
HEAD_TIMEOUT_S = 30.0  # a client that does not finish its head in this time is dropped
DRAIN_BYTES = 1 << 20  # after a refusal, read (and drop) up to this much of the body: no reset
DRAIN_TIMEOUT_S = 2.0
CHUNK = 64 * 1024
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection"}


@dataclass(frozen=True)
class Verdict:
    """What to do with one request head: forward ``head`` (status 0) or answer ``status``."""

    status: int
    detail: str = ""
    head: bytes = b""


def judge(raw: bytes, policy: OriginPolicy) -> Verdict:
    """Check a request head (up to and including the blank line) and rewrite it for smg."""
    lines = raw[:-4].split(b"\r\n") if raw.endswith(b"\r\n\r\n") else []
    if not lines or any(b"\n" in line or b"\r" in line for line in lines):
        return Verdict(400, "malformed request head")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[1].startswith(b"/"):
        return Verdict(400, "the gateway takes HTTP/1.x requests for a path on this server")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            return Verdict(400, "malformed header line")
        headers.append((name.lower(), value.strip()))
    hosts = [v for n, v in headers if n == b"host"]
    origins = [v for n, v in headers if n == b"origin"]
    if len(hosts) != 1 or len(origins) > 1:
        return Verdict(400, "a request needs exactly one Host header and at most one Origin")
    host = hosts[0]
    if not host or not policy.host_allowed(host):
        return Verdict(403, f"Host {host.decode('latin-1')!r} is not a name of this gateway (a DNS-rebound "
                            "name?); list it in APC_ALLOWED_HOSTS before apcctl fleet up")
    if origins and not policy.origin_allowed(origins[0], host):
        return Verdict(403, f"cross-origin requests from {origins[0].decode('latin-1')!r} are not accepted; "
                            "list the origin in APC_ALLOWED_ORIGINS before apcctl fleet up")
    kept = [line for line, (name, _) in zip(lines[1:], headers) if name not in HOP_BY_HOP]
    return Verdict(0, head=b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""]))


class HostGuard:
    """Listens on ``sock`` and forwards each checked request to smg on ``127.0.0.1:upstream_port``."""

    def __init__(self, sock: socket.socket, upstream_port: int, policy: OriginPolicy) -> None:
        self.sock = sock
        self.upstream_port = upstream_port
        self.policy = policy

    async def serve(self) -> None:
        server = await asyncio.start_server(self._handle, sock=self.sock, limit=MAX_HEAD_BYTES)
        async with server:
            await server.serve_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._one_request(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            await _refuse(reader, writer, Verdict(431, "request head too large"))
            return
        verdict = judge(raw, self.policy)
        if verdict.status:
            print(f"apcctl guard: {verdict.status} {verdict.detail}", file=sys.stderr, flush=True)
            await _refuse(reader, writer, verdict)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            await _refuse(reader, writer, Verdict(502, "the gateway (smg) behind the guard is not answering"))
            return
        try:
            up_writer.write(verdict.head)
            sending = asyncio.ensure_future(_copy(reader, up_writer))
            await _copy(up_reader, writer)  # until smg has answered and closed (Connection: close)
            sending.cancel()
        finally:
            up_writer.close()


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
    except (ConnectionError, OSError):
        pass


async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, verdict: Verdict) -> None:
    """A JSON ``{"detail": ...}`` answer (as the servers' own guard gives), then read and drop what
    the client still sends, so it sees the answer and not a reset."""
    body = json.dumps({"detail": verdict.detail}).encode()
    reason = {400: "Bad Request", 403: "Forbidden", 431: "Request Header Fields Too Large",
              502: "Bad Gateway"}.get(verdict.status, "Error")
    writer.write(f"HTTP/1.1 {verdict.status} {reason}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    try:
        await asyncio.wait_for(reader.read(DRAIN_BYTES), DRAIN_TIMEOUT_S)
    except (asyncio.TimeoutError, ConnectionError):
        pass


def listen(host: str, port: int) -> socket.socket:
    """The guard's socket, bound before smg starts (a busy port fails the start, not a request)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    sock.setblocking(False)
    return sock
