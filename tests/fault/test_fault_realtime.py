"""The realtime websocket loads only the served model (issue 34, item 6), with a real websocket client.

Stock mlx-vlm 0.7.10's ``/v1/realtime`` hands ``session.update``'s ``session.model`` (or the
``?model=`` query) to its worker, which loads whatever it names: any local directory, or a Hugging
Face repo it starts downloading. The HTTP routes have the served-model check
(``server_patch.serving.served``); here the websocket has it too. Against the real servers: the
patched one answers a foreign name with an ``error`` event ``model_not_found`` and its worker
never tries to load it (no loader error in the log), lets the served model through to the loader
(the tiny model is no VoiceChat model, so that load then fails, as on stock), and stock tries to
load ``/etc``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import connect

from tests.server_harness import PatchedServer

pytestmark = pytest.mark.server

FOREIGN = ("/etc", "some-org/some-voice-model")
LOADER_TRIED = "Realtime VoiceChat command failed"  # the worker's log line when a load (or open) raised


def session_update(server: PatchedServer, model: str | None, query: str = "") -> dict[str, Any]:
    """The event the server answers one ``session.update`` with, over a fresh websocket."""
    with connect(f"ws://127.0.0.1:{server.port}/v1/realtime{query}", open_timeout=60) as ws:
        created = json.loads(ws.recv(timeout=60))
        assert created["type"] == "session.created", created
        session = {"model": model} if model is not None else {}
        ws.send(json.dumps({"type": "session.update", "session": session}))
        return json.loads(ws.recv(timeout=300))


@pytest.mark.parametrize("model", FOREIGN)
def test_a_foreign_model_is_refused_before_the_worker_loads_it(patched: PatchedServer, model: str) -> None:
    before = len(patched.log_text())
    for event in (session_update(patched, model), session_update(patched, None, f"?model={model}")):
        assert event["type"] == "error" and event["error"]["code"] == "model_not_found", event
        assert repr(model) in event["error"]["message"] and "POST /admin/model" in event["error"]["message"]
    log = patched.log_text()[before:]
    assert LOADER_TRIED not in log and "Config not found" not in log, log


def test_the_served_model_reaches_the_loader(patched: PatchedServer) -> None:
    """The positive control: the check lets the served model through (trailing slash and all)."""
    event = session_update(patched, str(patched.model_dir) + "/")
    assert event["type"] == "error" and event["error"]["code"] == "session_initialization_failed", event
    assert "not a realtime VoiceChat model" in event["error"]["message"], event


def test_stock_loads_whatever_the_session_names(stock: PatchedServer) -> None:
    """What the reliability row says of stock: it hands ``/etc`` to its loader."""
    event = session_update(stock, "/etc")
    assert event["error"]["code"] == "session_initialization_failed", event
    assert "Config not found at /etc" in event["error"]["message"], event


def test_the_check_names_the_served_path_and_the_opt_in_restores_stock(monkeypatch: pytest.MonkeyPatch,
                                                                       tiny_model_dir: Path) -> None:
    from server_patch.serving import served

    monkeypatch.setattr(served, "SERVED", served.ServedModels())
    served.SERVED.serve(served.TEXT, str(tiny_model_dir), names=["tiny"])
    assert served.realtime_model("tiny") == served.realtime_model(f"{tiny_model_dir}/") == str(tiny_model_dir)
    with pytest.raises(served.ModelNotServed):
        served.realtime_model("/etc")
    served.SERVED.load_requested = True  # APC_LOAD_REQUESTED_MODEL=1
    assert served.realtime_model("/etc") == "/etc"
