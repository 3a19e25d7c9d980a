"""Faults at the admin edge: bad tokens, foreign origins, floods, oversized bodies, draining sockets.

Most checks share one real patched server on the tiny model (started under umask 0, with an
empty token file it must fill, and a cap of three event streams); the tests run in file order
and the last one stops it with streams open. The unit checks at the top need no server.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import stat
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import pytest

from tests.server_harness import HOST, PatchedServer, ServerError, assert_same_output, cached_tokens, text, wait_for
from tests.admin.test_admin_routes import call

STREAM_CAP = 3
EVIL = "http://evil.example"
MANAGEMENT = (("POST", "/unload"), ("PATCH", "/v1/settings"), ("POST", "/v1/cache/reset"))
PARAMS = {"max_tokens": 4, "logprobs": True, "top_logprobs": 5}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class umask:
    """Run a block under ``umask(value)``: files made there prove their modes are set explicitly."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __enter__(self) -> None:
        self.old = os.umask(self.value)

    def __exit__(self, *exc: object) -> None:
        os.umask(self.old)


# --- unit checks: token parsing and storage, journal modes, the guard in-process -----------------

@pytest.mark.parametrize("header, ok", [
    ("Bearer tok", True), (None, False), ("", False), ("Bearer", False), ("Bearer ", False),
    ("bearer tok", False), ("BEARER tok", False), ("Bearer  tok", False), ("Bearer tok ", False),
    ("Bearer tok\xa0", False), ("Bearer \xa0", False), ("Bearer t\u00f6k", False), ("Bearer tok\u20ac", False),
    (b"Bearer tok", True), (b"Bearer tok\xc2\xa0", False), ("Basic dG9r", False),
])
def test_token_matches_exact_bytes_only(header: Any, ok: bool) -> None:
    from server_patch.infra.auth import token_matches

    assert token_matches("tok", header) is ok
    assert token_matches("", "Bearer ") is False and token_matches("", "Bearer \xa0") is False


@pytest.mark.parametrize("content", [b"", b"\n", b"  \t\n"])
def test_a_blank_token_file_gets_a_fresh_private_token(tmp_path: Path, content: bytes) -> None:
    from server_patch.infra.auth import load_or_create_token

    path = tmp_path / "admin-token"
    path.write_bytes(content)
    os.chmod(path, 0o644)
    with umask(0):
        token = load_or_create_token(path)
    assert len(token) >= 32 and path.read_text() == token + "\n"
    assert mode(path) == 0o600
    assert load_or_create_token(path) == token  # read back, not regenerated


def test_a_missing_token_file_is_created_0600_in_0700_directories(tmp_path: Path) -> None:
    from server_patch.infra.auth import load_or_create_token

    path = tmp_path / "a" / "b" / "admin-token"
    with umask(0):
        token = load_or_create_token(path)
    assert path.read_text().strip() == token
    assert mode(path) == 0o600 and mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700
    assert not [p for p in path.parent.iterdir() if p.name != "admin-token"]  # no temp file left


def test_servers_starting_together_on_a_blank_file_agree_on_one_token(tmp_path: Path) -> None:
    from server_patch.infra.auth import load_or_create_token

    path = tmp_path / "admin-token"
    path.write_bytes(b"")
    barrier = threading.Barrier(8)

    def load(_: int) -> str:
        barrier.wait()
        return load_or_create_token(path)

    with ThreadPoolExecutor(8) as pool:
        tokens = set(pool.map(load, range(8)))
    assert tokens == {path.read_text().strip()}


@pytest.mark.parametrize("env", ["", "  ", "\t\n"])
def test_a_blank_token_variable_is_refused(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    from server_patch.infra.auth import TokenError, load_or_create_token

    monkeypatch.setenv("APC_ADMIN_TOKEN", env)
    with pytest.raises(TokenError, match="APC_ADMIN_TOKEN is blank"):
        load_or_create_token()


@pytest.mark.parametrize("content", ["t\u00f6ken\n".encode(), b"to\x01ken", "\u00a0\n".encode()])
def test_a_token_file_that_cannot_be_sent_is_refused_and_left_alone(tmp_path: Path, content: bytes) -> None:
    from server_patch.infra.auth import TokenError, load_or_create_token

    path = tmp_path / "admin-token"
    path.write_bytes(content)
    with pytest.raises(TokenError, match="printable ASCII"):
        load_or_create_token(path)
    assert path.read_bytes() == content


def test_journal_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    from server_patch.integration.journal import Journal, journal_files

    old = tmp_path / "journal"
    old.mkdir(mode=0o755)
    (old / "journal.jsonl.1").write_text("{}\n")
    os.chmod(old / "journal.jsonl.1", 0o644)
    with umask(0):
        journal = Journal(old, max_bytes=1024, files=3)
        for n in range(40):  # enough to rotate twice
            journal.append({"n": n, "tokens": list(range(8))})
        journal.close()
        fresh = Journal(tmp_path / "new" / "journal")
        fresh.close()
    files = journal_files(old)
    assert len(files) == 3 and all(mode(p) == 0o600 for p in files), [oct(mode(p)) for p in files]
    assert mode(old) == 0o700
    assert mode(tmp_path / "new") == 0o700 and mode(tmp_path / "new" / "journal") == 0o700
    assert mode(tmp_path / "new" / "journal" / "journal.jsonl") == 0o600


def _asgi(guard_kwargs: dict[str, Any], scope: dict[str, Any], chunks: Iterable[bytes]) -> tuple[int, dict, list]:
    """Drive an :class:`AdminGuard` over a recording inner app; returns (status, body, inner calls)."""
    from server_patch.infra.guard import AdminGuard, AdminLimits, StreamCount

    seen: list[dict[str, Any]] = []

    async def inner(scope: dict, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append({"headers": dict(scope["headers"]), "body": body})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages.append({"type": "http.request", "body": b"", "more_body": False})
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    kwargs = {"token": "tok", "limits": AdminLimits(max_event_streams=1, max_body_bytes=1000),
              "streams": StreamCount(), **guard_kwargs}
    base = {"type": "http", "method": "POST", "path": "/admin/anchors", "root_path": "", "headers": []}
    asyncio.run(AdminGuard(inner, **kwargs)(base | scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), seen


def test_guard_refuses_an_oversized_chunked_body_before_the_app_sees_it() -> None:
    auth = [(b"authorization", b"Bearer tok")]
    status, body, seen = _asgi({}, {"headers": auth}, [b"x" * 600, b"y" * 600])
    assert status == 413 and "1000 bytes" in body["detail"] and seen == []
    status, _, seen = _asgi({}, {"headers": auth}, [b'{"sys', b'tem": "a"}'])
    assert status == 200 and seen[0]["body"] == b'{"system": "a"}'  # a small body is replayed whole


def test_guard_accepts_the_admin_token_or_mlx_vlms_key_on_its_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With MLX_VLM_SERVER_API_KEY set, mlx-vlm checks its key itself; the admin token is passed on as it."""
    monkeypatch.setenv("MLX_VLM_SERVER_API_KEY", "key")
    scope = {"path": "/unload"}
    for supplied, outcome in ((b"Bearer tok", 200), (b"Bearer key", 200), (b"Bearer other", 401)):
        status, _, seen = _asgi({}, scope | {"headers": [(b"authorization", supplied)]}, [])
        assert status == outcome, supplied
        if outcome == 200:
            assert seen[0]["headers"][b"authorization"] == b"Bearer key"
    status, _, _ = _asgi({}, {"path": "/admin/status", "method": "GET",
                              "headers": [(b"authorization", b"Bearer key")]}, [])
    assert status == 401  # mlx-vlm's key is not the admin token


# --- the real server ---------------------------------------------------------------------------


def raw(server: PatchedServer, method: str, path: str, headers: Iterable[tuple[str, str | bytes]] = (),
        body: bytes | Iterable[bytes] | None = None, *, host: str | None = None) -> tuple[int, dict[str, str], Any]:
    """One request with headers sent byte for byte (http.client), body bytes or chunks; ``host``
    replaces the Host header."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=120)
    try:
        conn.putrequest(method, path, skip_host=host is not None, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        chunked = body is not None and not isinstance(body, bytes)
        for name, value in headers:
            conn.putheader(name, value)
        if isinstance(body, bytes):
            conn.putheader("Content-Length", str(len(body)))
        elif chunked:
            conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        if isinstance(body, bytes):
            conn.send(body)
        elif chunked:
            for chunk in body:
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.send(b"0\r\n\r\n")
        response = conn.getresponse()
        payload = response.read()
        found = {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()
    decoded = json.loads(payload) if "json" in found.get("content-type", "") else payload.decode()
    return response.status, found, decoded


def cors_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith("access-control-")}


def status_of(server: PatchedServer) -> dict[str, Any]:
    status, _, body = call(server, "GET", "/admin/status", token=server.token)
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("fault-admin")
    token_file = log_dir / "admin-token"
    token_file.write_bytes(b"")  # empty: the server must generate a token into it
    os.chmod(token_file, 0o644)
    running = PatchedServer(tiny_model_dir, log_dir=log_dir, env={
        "APC_ADMIN_TOKEN": None, "APC_ADMIN_TOKEN_FILE": str(token_file), "TOP_LOGPROBS_K": "5",
        "APC_ADMIN_MAX_EVENT_STREAMS": str(STREAM_CAP), "APC_JOURNAL_SNAPSHOT_S": "0"})
    with umask(0):  # the server's files must be private by their own doing
        running.start()
    try:
        running.token = token_file.read_text().strip()
        running.token_file = token_file
        yield running
    finally:
        running.stop()


@pytest.mark.server
def test_the_empty_token_file_was_filled_with_a_private_token(server: PatchedServer) -> None:
    assert len(server.token) >= 32 and mode(server.token_file) == 0o600
    assert status_of(server)["server"]["pid"] == server.pid
    assert "was blank: a new token was generated" in server.log_text()


AUTH_PROBES = {
    "no header": None,
    "wrong token": "Bearer wrong-token",
    "bearer and nbsp": b"Bearer \xa0",
    "token then nbsp": "Bearer {token}\xa0",
    "non-ascii bytes": "Bearer t\u00ebst-\u00e4dmin".encode(),
    "latin-1 bytes": b"Bearer \xe9\xff\x80",
    "lower-case scheme": "bearer {token}",
    "two spaces": "Bearer  {token}",
    "no space": "Bearer{token}",
    "other scheme": "Basic {token}",
}


@pytest.mark.server
@pytest.mark.parametrize("probe", list(AUTH_PROBES))
@pytest.mark.parametrize("method, path", [("GET", "/admin/status"), ("POST", "/admin/drain"), *MANAGEMENT])
def test_auth_probes_are_401_json(server: PatchedServer, probe: str, method: str, path: str) -> None:
    """A trailing ASCII space cannot be probed over HTTP (the parser drops it as whitespace);
    the unit test above checks it; a trailing NBSP is probed here instead."""
    value = AUTH_PROBES[probe]
    if isinstance(value, str):
        value = value.format(token=server.token).encode("latin-1")
    headers = [("Authorization", value)] if value is not None else []
    body = b"{}" if method != "GET" else None
    status, found, answer = raw(server, method, path, [*headers, ("Content-Type", "application/json")], body)
    assert status == 401, (probe, answer)
    assert found["www-authenticate"] == "Bearer" and "admin token" in answer["detail"]
    assert status_of(server)["idle"]["draining"] is False
    assert call(server, "GET", "/health", token=None)[2]["loaded_model"]  # /unload did nothing


@pytest.mark.server
def test_management_routes_work_with_the_token(server: PatchedServer) -> None:
    messages = [{"role": "user", "content": text(80, 31)}]
    server.chat(messages, tenant="reset", max_tokens=2)
    assert any(e["tier"] != "disk" for e in call(server, "GET", "/admin/entries?tier=ram", token=server.token)[2]["entries"])
    status, _, body = call(server, "POST", "/v1/cache/reset", token=server.token)
    assert status == 200 and body["enabled"] is True
    # The reset clears the lineage cache's RAM entries too, as stock clears its own.
    assert call(server, "GET", "/admin/entries?tier=ram", token=server.token)[2]["entries"] == []
    assert status_of(server)["lineage"]["stats"]["resets"] >= 1
    status, _, body = call(server, "PATCH", "/v1/settings", {}, token=server.token)
    assert status == 200 and body["applied"] == {} and "current" in body
    assert call(server, "GET", "/v1/settings", token=None)[0] == 200  # reading stays as stock


@pytest.mark.server
@pytest.mark.parametrize("path", ["/admin/status", "/admin/anchors", "/unload", "/v1/settings", "/v1/cache/reset"])
def test_a_foreign_preflight_gets_no_cors_headers_on_admin_and_management(server: PatchedServer, path: str) -> None:
    preflight = [("Origin", EVIL), ("Access-Control-Request-Method", "POST"),
                 ("Access-Control-Request-Headers", "authorization, content-type")]
    status, found, answer = raw(server, "OPTIONS", path, preflight)
    assert status == 403 and cors_headers(found) == {} and "cross-origin" in answer["detail"]
    status, found, _ = raw(server, "POST", path, [("Origin", EVIL), ("Content-Type", "text/plain")], b"{}")
    assert status == 401 and cors_headers(found) == {}  # the request itself: no token, no CORS


@pytest.mark.server
def test_cors_on_inference_routes_is_off_unless_origins_are_listed(server: PatchedServer) -> None:
    """mlx-vlm allows every origin with credentials on its inference routes; with no
    APC_ALLOWED_ORIGINS the patch refuses a foreign one, preflight included (403, no CORS headers).
    A listed origin: tests/fault/test_fault_served_model.py."""
    preflight = [("Origin", EVIL), ("Access-Control-Request-Method", "POST"),
                 ("Access-Control-Request-Headers", "content-type")]
    status, found, answer = raw(server, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 403 and cors_headers(found) == {} and "APC_ALLOWED_ORIGINS" in answer["detail"]
    status, found, _ = raw(server, "GET", "/health", [("Origin", EVIL)])
    assert status == 403 and cors_headers(found) == {}
    status, found, _ = raw(server, "GET", "/admin/status", [("Origin", EVIL),
                                                             ("Authorization", f"Bearer {server.token}")])
    assert status == 200 and cors_headers(found) == {}  # the right token, yet no CORS on /admin


@pytest.mark.server
def test_oversized_admin_bodies_are_413_and_change_nothing(server: PatchedServer) -> None:
    auth = [("Authorization", f"Bearer {server.token}"), ("Content-Type", "application/json")]
    before_anchors = call(server, "GET", "/admin/anchors", token=server.token)[2]
    before_requests = call(server, "GET", "/admin/requests", token=server.token)[2]
    big = json.dumps({"system": "You are big. " * 90_000}).encode()  # about 1.1 MiB
    assert len(big) > 1 << 20
    for body in (big, [big[i:i + 65536] for i in range(0, len(big), 65536)]):  # sized, then chunked
        status, _, answer = raw(server, "POST", "/admin/anchors", auth, body)
        assert status == 413 and "APC_ADMIN_MAX_BODY_BYTES" in answer["detail"]
    status, _, answer = raw(server, "PATCH", "/v1/settings", auth, big)
    assert status == 413 and "detail" in answer
    assert call(server, "GET", "/admin/anchors", token=server.token)[2] == before_anchors
    assert call(server, "GET", "/admin/requests", token=server.token)[2] == before_requests
    assert status_of(server)["idle"]["in_flight"] == 0
    # A small chunked body is passed on whole.
    status, _, answer = raw(server, "POST", "/admin/drain", auth, [b'{"retry_', b'after": 3}'])
    assert status == 200 and answer["retry_after_s"] == 3
    assert call(server, "POST", "/admin/undrain", token=server.token)[0] == 200


def _conversation(n: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"You are helper {n}. " + text(80, 100 + n)},
            {"role": "user", "content": text(30, 200 + n)}]


@pytest.mark.server
def test_200_concurrent_admin_requests_while_chats_run(server: PatchedServer) -> None:
    """Every admin answer is well formed and every warm chat equals a cold prefill of the same prompt."""
    tenants = [f"flood-{n}" for n in range(3)]
    turns = []
    for n, tenant in enumerate(tenants):  # turn one, alone: the entry the loaded turn restores from
        first = server.chat(_conversation(n), tenant=tenant, **PARAMS)
        turns.append(_conversation(n) + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]
                                          or "."}, {"role": "user", "content": text(20, 300 + n)}])
    routes = ["/admin/status", "/admin/entries", "/admin/requests?limit=50", "/admin/metrics"]
    start = threading.Barrier(200 + len(turns))

    def admin(i: int) -> tuple[int, str, Any]:
        start.wait()
        status, headers, body = call(server, "GET", routes[i % len(routes)], token=server.token)
        return status, headers.get("content-type", ""), body

    def chat(n: int) -> dict[str, Any]:
        start.wait()
        return server.chat(turns[n], tenant=tenants[n], **PARAMS)

    with ThreadPoolExecutor(200 + len(turns)) as pool:
        chats = [pool.submit(chat, n) for n in range(len(turns))]
        answers = list(pool.map(admin, range(200)))
        warm = [c.result() for c in chats]
    for i, (status, kind, body) in enumerate(answers):
        assert status == 200, (routes[i % len(routes)], body)
        if routes[i % len(routes)] == "/admin/metrics":
            assert kind.startswith("text/plain") and "apc_requests_in_flight" in body
        else:
            assert "json" in kind and isinstance(body, dict)
    for n, answer in enumerate(warm):
        assert cached_tokens(answer) > 0, answer["usage"]  # it did restore under the flood
        cold = server.chat(turns[n], tenant=f"cold-{uuid.uuid4().hex[:8]}", **PARAMS)
        assert cached_tokens(cold) == 0
        assert_same_output(answer, cold)
    assert status_of(server)["idle"]["in_flight"] == 0


class EventStream:
    """One open ``/admin/events`` connection (its first line read), closed on demand."""

    def __init__(self, server: PatchedServer) -> None:
        self.conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
        self.conn.request("GET", "/admin/events", headers={"Authorization": f"Bearer {server.token}"})
        self.response = self.conn.getresponse()
        self.status = self.response.status
        self.headers = {k.lower(): v for k, v in self.response.getheaders()}
        if self.status == 200:
            assert self.response.readline().startswith(b": apc admin event stream")
            self.body = None
        else:
            self.body = json.loads(self.response.read())

    def close(self) -> None:
        if self.conn.sock is not None:
            self.conn.sock.close()
        self.conn.close()


@pytest.mark.server
def test_an_event_stream_flood_is_capped_and_the_server_keeps_serving(server: PatchedServer) -> None:
    streams = [EventStream(server) for _ in range(STREAM_CAP)]
    try:
        assert [s.status for s in streams] == [200] * STREAM_CAP
        extra = [EventStream(server) for _ in range(3)]
        for stream in extra:
            assert stream.status == 429 and int(stream.headers["retry-after"]) >= 1
            assert "APC_ADMIN_MAX_EVENT_STREAMS" in stream.body["detail"]
            stream.close()
        assert status_of(server)["admin"]["event_streams"] == STREAM_CAP
        answer = server.chat(_conversation(9), max_tokens=2)
        assert answer["choices"][0]["finish_reason"]
    finally:
        for stream in streams:
            stream.close()
    wait_for(lambda: status_of(server)["admin"]["event_streams"] == 0, "closed streams released", server)
    again = EventStream(server)
    assert again.status == 200
    again.close()
    assert status_of(server)["idle"]["in_flight"] == 0


@pytest.mark.server
def test_a_websocket_is_closed_with_1013_while_draining(server: PatchedServer) -> None:
    """mlx-vlm has one websocket route, /v1/realtime; a raw handshake is made to it."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = f"ws://{HOST}:{server.port}/v1/realtime"
    rejected = status_of(server)["idle"]["rejected_while_draining"]
    assert call(server, "POST", "/admin/drain", {"retry_after": 4}, token=server.token)[0] == 200
    try:
        with pytest.raises(ConnectionClosed) as closed:
            with connect(url, open_timeout=30) as socket:
                socket.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
        assert "draining" in closed.value.rcvd.reason and "retry after 4 s" in closed.value.rcvd.reason
        idle = status_of(server)["idle"]
        assert idle["rejected_while_draining"] == rejected + 1 and idle["in_flight"] == 0
    finally:
        assert call(server, "POST", "/admin/undrain", token=server.token)[0] == 200
    with connect(url, open_timeout=30) as socket:  # undrained: the endpoint itself answers
        assert json.loads(socket.recv(timeout=30))["type"] == "session.created"
    wait_for(lambda: status_of(server)["idle"]["in_flight"] == 0, "websocket finished", server)


@pytest.mark.server
def test_the_state_the_server_wrote_is_private(server: PatchedServer) -> None:
    """Started under umask 0: the journal (users' token ids) is still 0600 in 0700 directories."""
    state = server.log_dir / "state"
    journal = state / "journal"
    assert mode(state) == 0o700 and mode(journal) == 0o700
    files = list(journal.iterdir())
    assert files and all(mode(p) == 0o600 for p in files), [(p.name, oct(mode(p))) for p in files]


@pytest.mark.server
def test_unload_with_the_token_and_the_next_chat_reloads(server: PatchedServer) -> None:
    status, _, body = call(server, "POST", "/unload", token=server.token)
    assert status == 200 and body["status"] == "success"
    assert call(server, "GET", "/health", token=None)[2]["loaded_model"] is None
    assert server.chat(_conversation(11), max_tokens=2)["choices"][0]["finish_reason"]


@pytest.mark.server
def test_sigterm_with_event_streams_open_still_stops_gracefully(server: PatchedServer) -> None:
    streams = [EventStream(server) for _ in range(STREAM_CAP)]
    try:
        assert [s.status for s in streams] == [200] * STREAM_CAP
        code = server.stop(timeout=20)
    finally:
        for stream in streams:
            stream.close()
    assert code in (0, -15), server.log_tail()  # not -9: no SIGKILL was needed
    assert "Application shutdown complete" in server.log_text()


@pytest.mark.server
@pytest.mark.parametrize("value", ["  ", ""])
def test_a_blank_admin_token_variable_stops_the_server_at_start(tiny_model_dir: Path, tmp_path: Path,
                                                                value: str) -> None:
    server = PatchedServer(tiny_model_dir, log_dir=tmp_path, env={"APC_ADMIN_TOKEN": value})
    with pytest.raises(ServerError, match="exited with 1"):
        server.start()
    assert "cannot start the admin endpoint: APC_ADMIN_TOKEN is blank" in server.log_text()
    assert "Uvicorn running" not in server.log_text()
