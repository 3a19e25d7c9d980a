"""A shared server must not tell one user another's prompt through ``cached_tokens``.

An attacker on a shared server probes prompts and reads ``cached_tokens``: every probe that
restores tells it a token-exact prefix of what someone else sent. Injected into the real server
on the tiny model, over HTTP:

* ``cache_salt`` (vLLM's per-request field): the same prompt under another salt, or under none,
  restores nothing (``cached_tokens`` 0, restore kind ``cold``); the same salt restores; a salt
  that is not a non-empty string is a 400;
* ``APC_TENANT_FROM_USER=1``: a ``user`` sent with a ``+json`` content type or beside a blank
  tenant header stays that user's (before: the shared tenant's, where anyone could probe it);
* API keys (``--api-key``, ``--api-key-file``, ``APC_API_KEYS``): no key or a wrong one is a
  401 JSON (``/health`` stays open, ``/admin`` keeps its own token), two keys never share an
  entry even with the same tenant header, the keys never reach the log, and a configured but
  empty key list stops the server at start; the admin token stands in for a key in the keyless
  namespace (where ``/admin/anchors`` makes anchors), and ``apcctl anchors new --api-key`` makes
  one in a key's namespace.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Mapping

import pytest

from tests.fault.conftest import KEYS
from tests.server_harness import ADMIN_TOKEN, HOST, PatchedServer, ServerError, cached_tokens, text

pytestmark = pytest.mark.server


def _prompt(seed: int) -> list[dict[str, str]]:
    """A prompt no other test sends (a fresh system prompt, then 200 words)."""
    return [{"role": "system", "content": f"Session {uuid.uuid4().hex}."}, {"role": "user", "content": text(200, seed)}]


def _post(server: PatchedServer, messages: list[dict], headers: Mapping[str, str] | None = None,
          **fields: Any) -> tuple[int, Any]:
    payload = {"model": str(server.model_dir), "messages": messages, "temperature": 0.0, "max_tokens": 2, **fields}
    return server.request("POST", "/v1/chat/completions", payload, headers=headers)


def _reused(server: PatchedServer, messages: list[dict], headers: Mapping[str, str] | None = None,
            **fields: Any) -> tuple[int, str]:
    """(cached_tokens, restore kind) of one successful request."""
    before = len(server.lineage_lines("restore"))
    status, answer = _post(server, messages, headers, **fields)
    assert status == 200, answer
    lines = server.lineage_lines("restore")
    assert len(lines) == before + 1, server.log_tail()
    return cached_tokens(answer), lines[-1]["kind"]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_cache_salt_keeps_identical_prompts_apart(user_tenants: PatchedServer) -> None:
    messages = _prompt(301)
    assert _reused(user_tenants, messages, cache_salt="alice-secret") == (0, "cold")
    assert _reused(user_tenants, messages, cache_salt="mallory-guess") == (0, "cold")  # another salt: nothing
    assert _reused(user_tenants, messages) == (0, "cold")  # no salt (the shared tenant): nothing either
    again, kind = _reused(user_tenants, messages, cache_salt="alice-secret")
    assert again > 0 and kind != "cold", (again, kind)  # the same salt restores


def test_a_salt_that_is_not_a_non_empty_string_is_a_400(user_tenants: PatchedServer) -> None:
    for bad in ("", 7, ["s"], {"s": 1}, True):
        status, body = _post(user_tenants, _prompt(302), cache_salt=bad)
        assert status == 400 and "cache_salt" in body["detail"], (bad, status, body)


def test_the_user_field_is_the_tenant_whatever_the_json_content_type(user_tenants: PatchedServer) -> None:
    """Before: only ``application/json`` bodies were read, so ``+json`` put alice's prompt in the
    shared tenant, where the shared probe below restored it."""
    messages = _prompt(303)
    assert _reused(user_tenants, messages, {"Content-Type": "application/vnd.api+json"}, user="alice") == (0, "cold")
    assert _reused(user_tenants, messages) == (0, "cold")  # the shared tenant learns nothing
    assert _reused(user_tenants, messages, user="mallory") == (0, "cold")
    assert _reused(user_tenants, messages, user="alice")[0] > 0


def test_a_blank_tenant_header_does_not_hide_the_user_field(user_tenants: PatchedServer) -> None:
    """Before: a present but empty ``X-APC-Tenant`` skipped the user field and mlx-vlm fell back to
    the shared tenant (it reads ``header or default``)."""
    messages = _prompt(304)
    assert _reused(user_tenants, messages, {"X-APC-Tenant": ""}, user="bob") == (0, "cold")
    assert _reused(user_tenants, messages) == (0, "cold")
    assert _reused(user_tenants, messages, {"X-Tenant-Id": ""}, user="bob")[0] > 0


def test_inference_needs_a_key_and_health_does_not(keyed: PatchedServer) -> None:
    for headers in ({}, _bearer("not-a-key"), _bearer(KEYS[0] + "x"), {"Authorization": KEYS[0]},
                    {"x-api-key": ADMIN_TOKEN}, _bearer(ADMIN_TOKEN + "x")):
        status, body = _post(keyed, _prompt(305), headers)
        assert status == 401 and "API key" in body["detail"], (headers, status, body)
    status, body = keyed.request("GET", "/v1/models")
    assert status == 401 and "API key" in body["detail"]
    assert keyed.request("GET", "/v1/models", headers=_bearer(KEYS[1]))[0] == 200
    assert keyed.request("GET", "/health")[0] == 200  # a probe needs no key
    assert keyed.admin("GET", "/entries")[0] == 200  # /admin keeps its own token
    assert keyed.request("GET", "/admin/entries", headers=_bearer(KEYS[0]))[0] == 401  # and a key is not it
    status, body = _post(keyed, _prompt(306), {"x-api-key": KEYS[2]})  # Anthropic clients' header
    assert status == 200, body


def test_two_keys_never_share_an_entry(keyed: PatchedServer) -> None:
    messages = _prompt(307)
    same_tenant = {"X-APC-Tenant": "team"}
    assert _reused(keyed, messages, {**_bearer(KEYS[0]), **same_tenant}) == (0, "cold")
    for other in KEYS[1:]:  # the flag's key and the file's key: each its own namespace
        assert _reused(keyed, messages, {**_bearer(other), **same_tenant}) == (0, "cold")
    assert _reused(keyed, messages, {"x-api-key": KEYS[1], **same_tenant})[0] > 0  # one key, either header
    assert _reused(keyed, messages, {**_bearer(KEYS[0]), **same_tenant})[0] > 0


def test_keys_never_reach_the_log_and_the_key_file_is_made_private(keyed: PatchedServer) -> None:
    _post(keyed, _prompt(308), _bearer("wrong-" + KEYS[0]))
    _post(keyed, _prompt(308), _bearer(KEYS[0]))
    log = keyed.log_text()
    assert "Uvicorn running" in log or "Application startup complete" in log, log[-2000:]
    assert not any(key in log for key in KEYS), "an API key was logged"
    assert keyed.key_file.stat().st_mode & 0o077 == 0  # type: ignore[attr-defined]


def test_a_websocket_without_a_key_is_closed_with_1008(keyed: PatchedServer) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with pytest.raises(ConnectionClosed) as closed:
        with connect(f"ws://{HOST}:{keyed.port}/v1/realtime", open_timeout=30) as socket:
            socket.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


@pytest.mark.parametrize("env, args, message", [
    ({"APC_API_KEYS": " , "}, [], "holds no key"),
    ({}, ["--api-key-file", "{missing}"], "cannot be read"),
    ({"APC_API_KEYS": "caf\u00e9"}, [], "printable ASCII"),
    ({"APC_LINEAGE": "0", "APC_API_KEYS": "k"}, [], "stock mlx-vlm"),
])
def test_keys_that_cannot_be_used_stop_the_server_at_start(tiny_model_dir: Path, tmp_path: Path,
                                                           env: dict[str, str], args: list[str], message: str) -> None:
    args = [a.replace("{missing}", str(tmp_path / "no-such-file")) for a in args]
    server = PatchedServer(tiny_model_dir, env=env, args=args, log_dir=tmp_path, startup_timeout=60)
    with pytest.raises(ServerError, match="exited"):
        server.start()
    assert message in server.log_text(), server.log_tail()
    assert "Uvicorn running" not in server.log_text()


def test_an_empty_key_file_stops_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "keys"
    empty.write_text("# no keys yet\n\n")
    server = PatchedServer(tiny_model_dir, args=["--api-key-file", str(empty)], log_dir=tmp_path, startup_timeout=60)
    with pytest.raises(ServerError, match="exited"):
        server.start()
    assert "holds no key" in server.log_text(), server.log_tail()


def test_an_admin_anchor_serves_the_admin_token_and_not_the_keys(keyed: PatchedServer) -> None:
    """``POST /admin/anchors`` prefills in-process (no key needed) in the keyless namespace, which
    only the admin token reaches (``apcctl restart``'s probe): a key's sessions never restore it."""
    system = {"role": "system", "content": f"Anchor {uuid.uuid4().hex}. " + text(120, 309)}
    status, body = keyed.admin("POST", "/anchors", {"system": system["content"]})
    assert status == 200 and body["anchor"]["pinned"], body
    assert _reused(keyed, [system, {"role": "user", "content": text(40, 310)}], _bearer(KEYS[0])) == (0, "cold")
    reused, kind = _reused(keyed, [system, {"role": "user", "content": text(40, 311)}], _bearer(ADMIN_TOKEN))
    assert reused > 0 and kind == "anchor", (reused, kind)


def test_apcctl_makes_an_anchor_in_a_keys_namespace(keyed: PatchedServer, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from apcctl.cli import main

    system = f"Keyed anchor {uuid.uuid4().hex}. " + text(120, 312)
    (tmp_path / "system.txt").write_text(system)
    result = CliRunner().invoke(main, ["anchors", "new", "--system-file", str(tmp_path / "system.txt"),
                                       "--api-key", KEYS[1], "--server", keyed.base_url, "--token", ADMIN_TOKEN])
    assert result.exit_code == 0 and "pinned" in result.output, result.output
    assert KEYS[1] not in keyed.log_text()
    session = [{"role": "system", "content": system}, {"role": "user", "content": text(40, 313)}]
    assert _reused(keyed, session, _bearer(KEYS[0])) == (0, "cold")  # another key: nothing
    reused, kind = _reused(keyed, [session[0], {"role": "user", "content": text(40, 314)}], _bearer(KEYS[1]))
    assert reused > 0 and kind == "anchor", (reused, kind)
