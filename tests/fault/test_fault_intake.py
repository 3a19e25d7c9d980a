"""Bad bodies, media references and ``/metrics`` against the real patched server (issue 23, items 9, 11).

Every request here is refused (or answered) by the running server on the tiny model; no
request leaves loopback: the link-local address is refused before any connection, and a
loopback HTTP server of the test's own records whether the server ever fetched from it.
"""

from __future__ import annotations

import http.client
import http.server
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.fault.conftest import BODY_CAP as CAP
from tests.server_harness import ADMIN_TOKEN, HOST, PatchedServer

pytestmark = pytest.mark.server

LINK_LOCAL = "http://169.254.169.254/latest/meta-data/"  # refused by address, so never connected to


class Recorder:
    """A loopback HTTP server that records every path asked of it; ``/hop`` redirects to ``target``."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.target = ""
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                recorder.hits.append(self.path)
                if self.path == "/hop":
                    self.send_response(302)
                    self.send_header("Location", recorder.target)
                else:
                    self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://{HOST}:{self.server.server_port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    yield rec
    rec.close()


@pytest.fixture
def server(user_tenants: PatchedServer) -> PatchedServer:
    """Defaults but a 1 MiB body cap, and the tenant middleware on (it parsed every body too):
    the package's ``user_tenants`` server, which test_fault_tenancy shares."""
    return user_tenants


def post_raw(server: PatchedServer, body: bytes | Iterator[bytes], path: str = "/v1/chat/completions",
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """(status, JSON body) of a POST with exactly these bytes; an iterator is sent chunked."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=120)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})},
                     encode_chunked=not isinstance(body, bytes))
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def chat(server: PatchedServer, **fields: Any) -> dict[str, Any]:
    return {"model": str(server.model_dir), "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 2, "temperature": 0.0, **fields}


def with_image(server: PatchedServer, url: str) -> dict[str, Any]:
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return chat(server, messages=[{"role": "user", "content": content}])


def assert_serving(server: PatchedServer) -> None:
    assert server.process is not None and server.process.poll() is None, server.log_tail()
    assert server.chat([{"role": "user", "content": "Still there?"}], max_tokens=2)["choices"]


def test_a_100k_deep_body_is_a_400_json_not_a_traceback(server: PatchedServer) -> None:
    before = len(server.log_text())
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = post_raw(server, deep)
    assert status == 400 and "APC_INFERENCE_MAX_JSON_DEPTH" in body["detail"], (status, body)
    nested = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": []}
    for _ in range(200):  # below json's own limit: refused by the depth cap, not by a RecursionError
        nested = {"n": nested}
    assert post_raw(server, json.dumps(nested).encode())[0] == 400
    assert "Traceback" not in server.log_text()[before:]
    assert_serving(server)


def test_an_oversized_body_is_a_413_sized_or_chunked(server: PatchedServer) -> None:
    padding = b'{"model": "m", "pad": "' + b"x" * (2 * CAP) + b'"}'
    status, body = post_raw(server, padding)
    assert status == 413 and "APC_INFERENCE_MAX_BODY_BYTES" in body["detail"], (status, body)
    chunks = iter([padding[i:i + 65536] for i in range(0, len(padding), 65536)])
    assert post_raw(server, chunks)[0] == 413
    # Just under the cap still reaches mlx-vlm, which answers for its own reasons (no messages: a 422).
    fits = b'{"model": "m", "pad": "' + b"x" * (CAP - 64) + b'"}'
    assert len(fits) < CAP and post_raw(server, fits)[0] == 422
    assert_serving(server)


@pytest.mark.parametrize("case,fields,says", [
    ("empty messages", {"messages": []}, "at least one message"),
    ("logit_bias key not a token id", {"logit_bias": {"abc": 1}}, "not a token id"),
    ("logit_bias negative id", {"logit_bias": {"-5": 1}}, "not a token id"),
    ("logit_bias past the vocabulary (stock: a segfault)", {"logit_bias": {"99999999": 1}}, "past the vocabulary"),
    ("logit_bias value not a number", {"logit_bias": {"5": "x"}}, "must be a number"),
    ("logit_bias not an object", {"logit_bias": [1, 2]}, "must be an object"),
])
def test_bad_fields_are_400s_and_the_server_lives(server: PatchedServer, case: str, fields: dict[str, Any],
                                                  says: str) -> None:
    status, body = post_raw(server, json.dumps(chat(server, **fields)).encode())
    assert status == 400 and says in body["detail"], (case, status, body)
    assert_serving(server)


def test_a_lone_surrogate_is_a_400_and_a_pair_is_text(server: PatchedServer) -> None:
    model = json.dumps(str(server.model_dir)).encode()
    lone = b'{"model": %s, "max_tokens": 2, "messages": [{"role": "user", "content": "a \\ud800 b"}]}' % model
    status, body = post_raw(server, lone)
    assert status == 400 and "surrogate" in body["detail"], (status, body)
    pair = lone.replace(b"\\ud800", b"\\ud83d\\ude00")  # an emoji, written as its surrogate pair
    assert post_raw(server, pair)[0] == 200
    anthropic = b'{"model": %s, "max_tokens": 2, "messages": [{"role": "user", "content": "\\udfff"}]}' % model
    assert post_raw(server, anthropic, path="/v1/messages")[0] == 400


def test_media_on_private_hosts_and_local_paths_is_refused_before_any_fetch(server: PatchedServer,
                                                                            recorder: Recorder) -> None:
    refused = {
        LINK_LOCAL: "link-local",
        recorder.url("/chat.png"): "link-local",
        recorder.url("/chat.png").replace(HOST, "localhost"): "link-local",
        "/etc/passwd": "APC_ALLOWED_LOCAL_MEDIA_PATH",
        "file:///etc/passwd": "APC_ALLOWED_LOCAL_MEDIA_PATH",
        "ftp://example.invalid/a.png": "not supported",
    }
    for url, says in refused.items():
        status, body = post_raw(server, json.dumps(with_image(server, url)).encode())
        assert status == 400 and says in body["detail"], (url, status, body)
    # The Responses and Anthropic shapes name their media differently; the same policy applies.
    responses = {"model": str(server.model_dir), "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": recorder.url("/resp.png")}]}]}
    assert post_raw(server, json.dumps(responses).encode(), path="/v1/responses")[0] == 400
    anthropic = {"model": str(server.model_dir), "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": recorder.url("/anth.png")}}]}]}
    assert post_raw(server, json.dumps(anthropic).encode(), path="/v1/messages")[0] == 400
    assert recorder.hits == []  # nothing was fetched, loopback included
    assert_serving(server)


def test_metrics_keep_per_request_records_for_the_admin_token(server: PatchedServer) -> None:
    server.chat([{"role": "user", "content": "count me"}], max_tokens=2)
    status, anonymous = server.request("GET", "/metrics")
    assert status == 200 and "latest" not in anonymous and "recent" not in anonymous, anonymous
    assert anonymous["summary"]["requests_completed"] >= 1 and "last_error" not in anonymous["summary"]
    status, full = server.request("GET", "/v1/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 200 and full["latest"]["prompt_tokens"] > 0 and full["recent"], full


def test_the_opt_ins_restore_stock_fetching_local_files_and_open_metrics(
        tiny_model_dir: Path, tmp_path: Path, recorder: Recorder) -> None:
    media_dir = tmp_path / "media"
    media_dir.mkdir()
    (media_dir / "inside.png").write_bytes(b"not really a png")
    env = {"APC_MEDIA_PRIVATE_URLS": "1", "APC_METRICS_PUBLIC": "1"}
    args = ["--allowed-local-media-path", str(media_dir)]  # vLLM's flag, taken by the launcher
    with PatchedServer(tiny_model_dir, env=env, args=args, log_dir=tmp_path / "server") as server:
        url = recorder.url("/opted-in.png")
        status, body = post_raw(server, json.dumps(with_image(server, url)).encode())
        assert "/opted-in.png" in recorder.hits  # the positive control: this server may and does fetch
        assert status != 400 or "link-local" not in str(body), body
        inside = post_raw(server, json.dumps(with_image(server, str(media_dir / "inside.png"))).encode())
        assert "APC_ALLOWED_LOCAL_MEDIA_PATH" not in str(inside[1]), inside  # not refused (then mlx-vlm's turn)
        outside = media_dir / ".." / "outside.png"
        (tmp_path / "outside.png").write_bytes(b"x")
        status, body = post_raw(server, json.dumps(with_image(server, str(outside))).encode())
        assert status == 400 and "outside APC_ALLOWED_LOCAL_MEDIA_PATH" in body["detail"], body
        server.chat([{"role": "user", "content": "count me"}], max_tokens=2)
        assert server.get_json("/metrics")["latest"]["prompt_tokens"] > 0


def test_a_redirect_to_a_refused_host_is_not_followed(recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's own fetch checks every hop: here the policy lets the recorder's first hop through
    and refuses the link-local target it redirects to, which is never connected to."""
    from server_patch.intake import media

    recorder.target = LINK_LOCAL
    monkeypatch.setattr(media, "refusal", lambda url, policy: None if url.startswith(recorder.url("")) else "no")
    with pytest.raises(ValueError, match="no"):
        media.fetch(recorder.url("/hop"), timeout=10)
    assert recorder.hits[-1] == "/hop"


def test_references_are_found_in_every_shape_and_text_is_left_alone() -> None:
    from server_patch.intake import media

    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see http://169.254.169.254/ in prose"},
        {"type": "image_url", "image_url": {"url": "u1"}},
        {"type": "input_image", "image_url": "u2"},
        {"type": "image", "source": {"type": "url", "url": "u3"}},
        {"type": "image", "source": {"type": "base64", "data": "/9j/4AAQ"}},  # a JPEG's base64, not a path
        {"type": "input_audio", "input_audio": {"data": "./clip.wav", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "u5"}}]}],
        "input": [{"image": "u6"}, {"text": "no media"}]}
    assert sorted(media.references(body)) == ["./clip.wav", "u1", "u2", "u3", "u5", "u6"]


def test_the_media_flag_becomes_the_setting_and_stock_refuses_it() -> None:
    from server_patch.intake.flags import apply_media_flag

    environ: dict[str, str] = {}
    rest = apply_media_flag(["--port", "1", "--allowed-local-media-path=/a", "--allowed-local-media-path", "/b"],
                            environ)
    assert rest == ["--port", "1"] and environ == {"APC_ALLOWED_LOCAL_MEDIA_PATH": "/b"}
    with pytest.raises(SystemExit, match="stock"):
        apply_media_flag(["--allowed-local-media-path", "/a"], {}, patched=False)
