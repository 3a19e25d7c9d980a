"""Faults at the serving edge: a request naming another model, a foreign web page, a rebound name,
and the model switch that replaces the lineage runtime.

mlx-vlm 0.7.10 loads whatever a request names, unloading the served model first, and lets every
origin read every answer: a web page could empty the cache without a token. One real patched
server on the tiny model (started with a served name and one allowed origin) takes the attacks
first (nothing may change), then the admin switch: each replaced runtime is closed, its unwritten
entries on disk. The tests run in file order. The unit checks at the top need no server.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any, Iterable

import psutil
import pytest

from tests.server_harness import HOST, PatchedServer, cached_tokens, text
from tests.admin.test_admin_routes import call
from tests.fault.test_fault_admin import raw

EVIL = "http://evil.example"
UI = "http://ui.example:3000"
NAME = "tiny-chat"


# --- unit checks: name normalisation, the origin and host policy, the launcher's flags ------------

def test_names_normalise_to_one_spelling(tmp_path: Path) -> None:
    from server_patch.serving.served import Served, normalise

    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "link").symlink_to(model)
    served = Served.of(str(model), names=["chat"])
    for same in (str(model), f"{model}/", f"{model}//", f" {model} ", str(tmp_path / "link"), f"{tmp_path}/./model",
                 "chat", "chat/"):
        assert served.answers_to(same), same
    for other in ("/etc", str(tmp_path), f"{model}x", "Chat", "", None, "\x00", "x" * 5000):
        assert not served.answers_to(other), other
    assert normalise("mlx-community/Qwen2-VL/") == "mlx-community/Qwen2-VL"


def test_resolve_serves_the_served_spelling_or_raises_404() -> None:
    from server_patch.serving.served import ModelNotServed, ServedModels, error_body

    inherit = object()
    served = ServedModels()
    served.capture({"MLX_VLM_PRELOAD_MODEL": "org/model", "MLX_VLM_PRELOAD_EMBEDDING_MODEL": "org/embed",
                    "APC_SERVED_MODEL_NAME": "chat,other"})
    assert served.resolve("text_generation", "org/model/", inherit, inherit=inherit) == ("org/model", None)
    assert served.resolve("text_generation", "other", None, inherit=inherit) == ("org/model", None)
    assert served.resolve("embedding", "org/embed", inherit, inherit=inherit) == ("org/embed", None)
    for group, name, adapter in (("text_generation", "/etc", inherit), ("embedding", "org/model", inherit),
                                 ("image_edit", "org/model", inherit), ("text_generation", "chat", "/etc")):
        with pytest.raises(ModelNotServed) as caught:
            served.resolve(group, name, adapter, inherit=inherit)
        body = error_body(caught.value)
        assert caught.value.status_code == 404 and body["error"]["code"] == "model_not_found"
        assert body["error"]["param"] == ("adapter_path" if adapter is not inherit else "model")
    stock = ServedModels()
    stock.capture({"MLX_VLM_PRELOAD_MODEL": "org/model", "APC_LOAD_REQUESTED_MODEL": "1"})
    assert stock.resolve("text_generation", "/etc", inherit, inherit=inherit) == ("/etc", inherit)


@pytest.mark.parametrize("host, ok", [
    (None, True), (b"127.0.0.1:8080", True), (b"[::1]:8080", True), (b"10.1.2.3", True), (b"localhost:8080", True),
    (b"app.localhost", True), (b"LOCALHOST.", True), (b"ui.example:3000", True), (b"box.lan:8080", True),
    (b"evil.example:8080", False), (b"127.0.0.1.evil.example", False), (b"localhost.evil.example", False),
    (b"mac-studio.local:8080", True), (b"gpu.internal", True), (b"evil.local.example", False),
    (b"[::1", False), (b"", False),
])
def test_host_policy(host: bytes | None, ok: bool) -> None:
    from server_patch.serving.origins import OriginPolicy

    policy = OriginPolicy.from_env({"APC_ALLOWED_ORIGINS": UI}, bound_hosts=["box.lan"])
    assert policy.host_allowed(host) is ok
    assert OriginPolicy.from_env({"APC_ALLOWED_HOSTS": "*"}, bound_hosts=[]).host_allowed(b"evil.example")
    assert OriginPolicy.from_env({}, bound_hosts=[]).host_allowed(socket.gethostname().encode())  # this machine


@pytest.mark.parametrize("origin, host, ok", [
    (UI, b"127.0.0.1:8080", True), (UI.upper() + "/", b"127.0.0.1:8080", True), (EVIL, b"127.0.0.1:8080", False),
    ("null", b"127.0.0.1:8080", False), ("http://ui.example:3001", b"127.0.0.1:8080", False),
    ("http://127.0.0.1:8080", b"127.0.0.1:8080", True), ("http://127.0.0.1:8081", b"127.0.0.1:8080", False),
])
def test_origin_policy(origin: str, host: bytes, ok: bool) -> None:
    from server_patch.serving.origins import OriginPolicy

    assert OriginPolicy.from_env({"APC_ALLOWED_ORIGINS": UI}, bound_hosts=[]).origin_allowed(origin.encode(), host) is ok
    assert OriginPolicy.from_env({"APC_ALLOWED_ORIGINS": "*"}, bound_hosts=[]).origin_allowed(EVIL.encode(), host)


def test_launcher_flags_become_settings_and_leave_the_argv() -> None:
    from server_patch.serving import origins
    from server_patch.serving.flags import apply_serving_flags

    env: dict[str, str] = {"APC_SERVED_MODEL_NAME": "from-env"}
    hosts_before = list(origins.BOUND_HOSTS)
    try:
        rest = apply_serving_flags(["--served-model-name", "a", "--port", "1", "--served-model-name=b,c",
                                    "--allowed-origins", UI, "--host", "box.lan"], env)
        assert rest == ["--port", "1", "--host", "box.lan"]
        assert env == {"APC_SERVED_MODEL_NAME": "a,b,c", "APC_ALLOWED_ORIGINS": UI}
        assert origins.BOUND_HOSTS[-1] == "box.lan"
    finally:
        origins.BOUND_HOSTS[:] = hosts_before
    with pytest.raises(SystemExit, match="needs a value"):
        apply_serving_flags(["--allowed-origins"], {})
    with pytest.raises(SystemExit, match="stock mlx-vlm"):
        apply_serving_flags(["--served-model-name", "a"], {}, patched=False)


def test_serve_flags_and_config_keys_reach_the_server_environment(tmp_path: Path, tiny_model_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from apcctl.commands.serve import server_spec, serving_env
    from apcctl.config import ConfigError, load_config

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    for name in ("APC_SERVED_MODEL_NAME", "APC_ALLOWED_ORIGINS", "APC_ALLOWED_HOSTS"):
        monkeypatch.delenv(name, raising=False)
    assert serving_env(("a", "b"), (UI,)) == ["APC_SERVED_MODEL_NAME=a,b", f"APC_ALLOWED_ORIGINS={UI}"]
    config = tmp_path / "config.toml"
    config.write_text(f'[servers.s]\nmodel = "{tiny_model_dir}"\nserved_model_name = ["chat", "glm"]\n'
                      f'allowed_origins = "{UI}"\nallowed_hosts = ["box.lan"]\n', encoding="utf-8")
    spec, _ = server_spec("s", None, 18080, None, None, (), config, ())
    assert (spec.env["APC_SERVED_MODEL_NAME"], spec.env["APC_ALLOWED_ORIGINS"], spec.env["APC_ALLOWED_HOSTS"]) == \
        ("chat,glm", UI, "box.lan")
    spec, _ = server_spec("s", None, 18080, None, None, tuple(serving_env(("flag",), ())), config, ())
    assert spec.env["APC_SERVED_MODEL_NAME"] == "flag"  # the command line wins over the config
    config.write_text('[servers.s]\nserved_model_name = ["a,b"]\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="served_model_name"):
        load_config(config)


def test_a_closed_cache_and_store_write_nothing_more(tmp_path: Path, model: Any, layout: Any) -> None:
    """What a replaced runtime's close leaves: a draining generation's commit is refused and a
    write is refused at once (the entry stays unwritten); the next store's writer runs on the
    closed one's thread (``infra.workers``: MLX never frees a thread's stream)."""
    from tests.fake_model import random_tokens
    from server_patch.disk.space import DiskUnavailable
    from server_patch.infra.workers import PARK
    from tests.disk.test_disk_store import make_cache, serve

    cache, store = make_cache(tmp_path, layout)
    _, entry, _ = serve(cache, model, layout, random_tokens(120, 1))
    cache.flush()
    assert store.close(timeout=60) is True and store.closed
    started = PARK.counts()["threads"]
    assert [f.name for f in tmp_path.glob("*.safetensors")] == [f"{entry.id}.safetensors"]
    cache.close()
    _, late, _ = serve(cache, model, layout, random_tokens(120, 2))  # committed after the close
    assert late is None and cache.stats["refused_closed"] == 1 and [e.id for e in cache.entries()] == [entry.id]
    with pytest.raises(DiskUnavailable, match="closed"):
        store.write(entry, lambda *_: None)
    # Another store on the directory (the next runtime) writes on the same thread, lent again.
    again, second = make_cache(tmp_path, layout)
    serve(again, model, layout, random_tokens(120, 3))
    assert again.flush() == 1 and second.flush(timeout=60)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    assert PARK.counts()["threads"] == started  # no thread started for it


# --- the real server ---------------------------------------------------------------------------------

def send(server: PatchedServer, method: str, path: str, headers: Iterable[tuple[str, str]] = (),
         body: Any = None, *, host: str | None = None) -> tuple[int, dict[str, str], Any]:
    """One request with exactly these headers (``host`` replaces the Host header), a JSON body."""
    return raw(server, method, path, headers, None if body is None else json.dumps(body).encode(), host=host)


def cors(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith("access-control-")}


def chat_body(model: str, seed: int = 1, words: int = 40) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text(words, seed)}], "max_tokens": 2,
            "temperature": 0.0}


def model_state(server: PatchedServer) -> dict[str, Any]:
    status, _, body = call(server, "GET", "/admin/model", token=server.token)
    assert status == 200, body
    return body


def ram_ids(server: PatchedServer) -> set[str]:
    return {e["id"] for e in call(server, "GET", "/admin/entries?tier=ram", token=server.token)[2]["entries"]}


@pytest.fixture(scope="module")
def copy_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights in another directory: another model to mlx-vlm, the same disk directory."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("served") / "tiny-copy"))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, copy_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # copy_dir exists before the server starts: weight files newer than the process keep its disk tier off.
    log_dir = tmp_path_factory.mktemp("fault-served")
    running = PatchedServer(tiny_model_dir, log_dir=log_dir, env={"APC_LINEAGE_DISK_WRITE_DELAY_S": "3600"},
                            args=["--served-model-name", NAME, "--allowed-origins", UI])
    running.start()
    running.token = running.env["APC_ADMIN_TOKEN"]
    try:
        yield running
    finally:
        running.stop()


@pytest.mark.server
def test_a_request_naming_another_model_changes_nothing(server: PatchedServer) -> None:
    served = str(server.model_dir)
    for seed in (1, 2, 3):
        assert call(server, "POST", "/v1/chat/completions", chat_body(served, seed), token=None)[0] == 200
    before, entries = model_state(server), ram_ids(server)
    assert entries and before["lineage"]["open_runtimes"] == 1
    for name in ("/etc", "/", "not-a-model", served + "-other", str(server.model_dir.parent)):
        status, _, answer = call(server, "POST", "/v1/chat/completions", chat_body(name), token=None)
        assert status == 404 and answer["error"]["code"] == "model_not_found", (name, answer)
    status, _, answer = call(server, "POST", "/v1/chat/completions", {**chat_body(served), "adapter_path": "/etc"},
                             token=None)
    assert status == 404 and answer["error"]["param"] == "adapter_path"
    status, _, answer = call(server, "POST", "/v1/messages", {"model": "/etc", "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]},
                             token=None)
    assert status == 404 and answer["error"]["type"] == "not_found_error", answer
    after = model_state(server)
    assert after["lineage"]["runtime_started"] == before["lineage"]["runtime_started"]  # never rebuilt
    assert ram_ids(server) == entries and after["loaded_model"] == served
    # The served model's other spellings and its served name are the served model: nothing reloads.
    for name in (served + "/", served + "//", NAME, f" {served} "):
        status, _, answer = call(server, "POST", "/v1/chat/completions", chat_body(name, 1), token=None)
        assert status == 200 and cached_tokens(answer) > 0, (name, answer)
    assert model_state(server)["lineage"]["runtime_started"] == before["lineage"]["runtime_started"]
    assert entries <= ram_ids(server)


@pytest.mark.server
def test_a_foreign_web_page_is_refused_before_anything_runs(server: PatchedServer) -> None:
    before = model_state(server)["lineage"]["runtime_started"]
    # The attack of the issue: a simple (no-preflight) cross-origin POST naming another model.
    status, found, answer = send(server, "POST", "/v1/chat/completions",
                                 [("Origin", EVIL), ("Content-Type", "text/plain")], chat_body("/etc"))
    assert status == 403 and cors(found) == {} and "APC_ALLOWED_ORIGINS" in answer["detail"]
    preflight = [("Access-Control-Request-Method", "POST"), ("Access-Control-Request-Headers", "content-type")]
    for path in ("/v1/chat/completions", "/v1/models", "/health"):
        status, found, _ = send(server, "OPTIONS", path, [("Origin", EVIL), *preflight])
        assert status == 403 and cors(found) == {}, path
    assert send(server, "GET", "/health", [("Origin", EVIL)])[0] == 403
    # A listed origin gets mlx-vlm's own CORS answer; the server's own origin needs none.
    status, found, _ = send(server, "OPTIONS", "/v1/chat/completions", [("Origin", UI), *preflight])
    assert status == 200 and found["access-control-allow-origin"] == UI
    status, found, answer = send(server, "POST", "/v1/chat/completions",
                                 [("Origin", UI), ("Content-Type", "application/json")], chat_body(NAME))
    assert status == 200 and found["access-control-allow-origin"] == UI, answer
    own = f"http://{HOST}:{server.port}"
    assert send(server, "GET", "/health", [("Origin", own)])[0] == 200
    assert model_state(server)["lineage"]["runtime_started"] == before


@pytest.mark.server
def test_a_rebound_host_name_is_refused_on_every_route(server: PatchedServer) -> None:
    auth = [("Authorization", f"Bearer {server.token}")]
    for method, path, headers, body in (("GET", "/health", [], None), ("GET", "/admin/status", auth, None),
                                        ("POST", "/v1/chat/completions", [("Content-Type", "application/json")],
                                         chat_body(NAME))):
        status, _, answer = send(server, method, path, headers, body, host=f"evil.example:{server.port}")
        assert status == 403 and "APC_ALLOWED_HOSTS" in answer["detail"], (path, answer)
    for host in (f"localhost:{server.port}", f"{HOST}:{server.port}", "ui.example:3000"):
        assert send(server, "GET", "/health", host=host)[0] == 200, host


@pytest.mark.server
def test_switching_the_model_needs_the_admin_token(server: PatchedServer, copy_dir: Path) -> None:
    body = {"model": str(copy_dir), "served_model_name": ["copy"]}
    assert call(server, "POST", "/admin/model", body, token=None)[0] == 401
    assert send(server, "POST", "/admin/model", [("Origin", EVIL), ("Content-Type", "text/plain")], body)[0] == 401
    assert model_state(server)["loaded_model"] == str(server.model_dir)
    status, _, state = call(server, "POST", "/admin/model", body, token=server.token)
    assert status == 200 and state["loaded_model"] == str(copy_dir), state
    assert state["served"]["text_generation"] == {"model": str(copy_dir), "adapter": None,
                                                  "served_model_names": ["copy"]}
    assert call(server, "POST", "/v1/chat/completions", chat_body(str(server.model_dir)), token=None)[0] == 404
    assert call(server, "POST", "/v1/chat/completions", chat_body(NAME), token=None)[0] == 404
    assert call(server, "POST", "/v1/chat/completions", chat_body("copy"), token=None)[0] == 200
    # A model that cannot load: 422, and the old one is served (and loaded) again.
    status, _, answer = call(server, "POST", "/admin/model", {"model": "/etc"}, token=server.token)
    assert status == 422 and "still serving" in answer["detail"], answer
    assert model_state(server)["loaded_model"] == str(copy_dir)
    assert call(server, "POST", "/v1/chat/completions", chat_body("copy"), token=None)[0] == 200


def journal_opens(pid: int) -> int:
    return sum(1 for f in psutil.Process(pid).open_files() if Path(f.path).name == "journal.jsonl")


@pytest.mark.server
def test_each_switch_closes_the_runtime_it_replaces(server: PatchedServer, copy_dir: Path) -> None:
    models = [str(server.model_dir), str(copy_dir)]
    conversation = chat_body(models[0], seed=77, words=60)
    threads: list[int] = []
    parked: list[dict[str, int]] = []
    for round_ in range(6):
        model = models[round_ % 2]
        status, _, state = call(server, "POST", "/admin/model", {"model": model}, token=server.token)
        assert status == 200 and state["loaded_model"] == model, state
        assert state["lineage"]["open_runtimes"] == 0  # the replaced one is closed; the next starts lazily
        if round_ == 0:
            # An entry that is unwritten (the write delay is an hour) when its model is replaced...
            answer = call(server, "POST", "/v1/chat/completions", conversation, token=None)[2]
            assert cached_tokens(answer) == 0
            stats = call(server, "GET", "/admin/status", token=server.token)[2]["lineage"]["stats"]
            assert stats.get("disk_writes", 0) == 0
        else:
            assert call(server, "POST", "/v1/chat/completions", chat_body(model, round_), token=None)[0] == 200
        lineage = model_state(server)["lineage"]
        # One runtime, its ticker and disk writer (the replaced runtime's closed); the journal open once.
        assert lineage["open_runtimes"] == 1 and lineage["threads"] == ["apc-lineage-disk", "apc-lineage-tick"]
        assert journal_opens(server.pid) == 1
        threads.append(psutil.Process(server.pid).num_threads())
        parked.append(lineage["worker_threads"])
    # The workers' threads are the closed runtime's, lent again (infra.workers): none started per switch.
    assert parked[0]["threads"] >= 2 and all(p == parked[0] for p in parked), parked
    # Native threads: mlx-vlm starts a generation thread per load, and MLX never frees the stream
    # thread of a thread that ran MLX work: one per switch is left, mlx-vlm's (before: four, two
    # of them ours); the bound leaves one more per switch for a thread pool that grows.
    assert threads[-1] - threads[1] <= 2 * (len(threads) - 2), threads
    # ... was written by the close, so the same model restores it from disk after the switches.
    assert model_state(server)["loaded_model"] == models[1]
    assert call(server, "POST", "/admin/model", {"model": models[0]}, token=server.token)[0] == 200
    answer = call(server, "POST", "/v1/chat/completions", conversation, token=None)[2]
    assert cached_tokens(answer) > 0, answer
    assert "closed (its model was unloaded); unwritten entries none" in server.log_text()
