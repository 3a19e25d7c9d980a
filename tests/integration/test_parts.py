"""The composition root and the one door, without a model: the server's parts are one object
that is handed on (``integration.parts``), and the door acts only on a lineage coordinator.

The real server path (parts built with mlx-vlm's ``ServerRuntime``, the admin routes, a model
switch closing the replaced runtime) is exercised by ``test_admin_routes``, ``test_canary`` and
``test_fault_served_model``; these tests pin the seams those rely on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server_patch.admin.api import install
from server_patch.integration import hooks as door
from server_patch.integration.parts import Parts

TOKEN = "parts-test-token-0123456789abcdef"


@dataclass
class _Config:
    shutdown_flush_s: float = 3.0


@dataclass
class _Runtime:
    """What ``Runtimes`` asks of a lineage runtime: its name, close and flush (no model)."""

    fingerprint: str
    config: _Config = field(default_factory=_Config)
    closed: bool = False
    flushed: list[float] = field(default_factory=list)

    def close(self) -> None:
        self.closed = True

    def flush(self, timeout: float) -> None:
        self.flushed.append(timeout)


def test_a_new_managers_runtime_replaces_the_open_one_which_is_closed_first():
    parts, old_manager, new_manager = Parts.from_env(), object(), object()
    old, new = _Runtime("old" * 6), _Runtime("new" * 6)
    parts.runtimes.adopt(old_manager, old, parts)
    assert parts.runtimes.current is old and parts.runtimes.count() == 1
    assert (old.finder, old.canary) == (parts.finder, parts.canary)  # it reads the server's parts

    parts.runtimes.replacing(old_manager)  # the same model's next generator: nothing closes
    assert not old.closed and parts.runtimes.count() == 1
    parts.runtimes.replacing(new_manager)  # another model: the open runtime is closed first
    assert old.closed and parts.runtimes.current is None
    parts.runtimes.adopt(new_manager, new, parts)
    assert parts.runtimes.current is new and parts.runtimes.count() == 1


def test_retire_closes_the_unloaded_models_runtime_and_the_shutdown_flush_goes_through_the_parts():
    parts, manager = Parts.from_env(), object()
    runtime = _Runtime("r" * 16)
    parts.runtimes.adopt(manager, runtime, parts)
    door.shutdown(parts)
    assert runtime.flushed == [runtime.config.shutdown_flush_s] and not runtime.closed
    door.model_unloading(parts, object())  # another manager: nothing of this one closes
    assert not runtime.closed
    door.model_unloading(parts, manager)
    assert runtime.closed and parts.runtimes.count() == 0
    door.shutdown(parts)
    assert runtime.flushed == [runtime.config.shutdown_flush_s]  # a closed runtime is not flushed again


class _StockLike:
    """Has every lineage method, by name, and each raises: the door must never call them."""

    def __getattr__(self, name: str):
        def called(*args, **kwargs):
            raise AssertionError(f"the door called {name} on a coordinator that is not the lineage's")
        return called


@pytest.mark.parametrize("call", [
    lambda c: door.generator_started(c, object()),
    lambda c: door.rows_bound(c, [1], [{}]),
    lambda c: door.batches_joining(c, object(), object()),
    lambda c: door.rows_leaving(c, object(), [0]),
    lambda c: door.rows_decoded(c, object(), [5]),
    lambda c: door.request_removed(c, 1),
    lambda c: door.prefill_completed(c, 1, {"request_id": "r"}, 0.1),
    lambda c: door.first_token(c, 1, "r", 0.1),
    lambda c: door.cancelled(c, 1, {"request_id": "r"}, None),
], ids=["attach", "bind", "join", "leave", "decode", "remove", "prefill", "first_token", "cancel"])
def test_the_door_calls_nothing_on_a_coordinator_that_is_not_the_lineage_caches(call, monkeypatch):
    monkeypatch.setenv("APC_TEST_FAULTS", "1")  # a call would re-raise, not be logged away
    call(_StockLike())
    call(None)  # no APC at all


@pytest.fixture()
def admin_app(tmp_path, monkeypatch):
    def build() -> tuple[TestClient, Parts]:
        app, parts = FastAPI(), Parts.from_env()
        install(app, parts)
        return TestClient(app), parts

    monkeypatch.setenv("APC_ADMIN_TOKEN", TOKEN)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    return build


def test_each_app_serves_the_parts_it_was_handed(admin_app):
    """Two apps, two sets of parts: a drain on one gates only its own traffic (no shared gate)."""
    (one, one_parts), (two, two_parts) = admin_app(), admin_app()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert one.post("/admin/drain", json={"retry_after": 7}, headers=auth).status_code == 200
    assert one_parts.traffic.draining and one_parts.traffic.retry_after == 7
    assert not two_parts.traffic.draining
    assert one.get("/admin/status", headers=auth).json()["idle"]["draining"] is True
    assert two.get("/admin/status", headers=auth).json()["idle"]["draining"] is False
    one_parts.canary.book.suspects["ram"] = {"reason": "test"}
    assert one.get("/admin/status", headers=auth).json()["canary"]["suspects"] == ["ram"]
    assert two.get("/admin/verify", headers=auth).json()["suspects"] == {}
    assert one.get("/admin/model", headers=auth).json()["lineage"]["open_runtimes"] == 0
    assert one.get("/admin/entries/x", headers=auth).status_code == 409  # no runtime adopted yet


def test_a_failing_lineage_hook_is_logged_by_the_door(caplog, monkeypatch):
    from server_patch.integration.coordinator import LineageCoordinator

    class Broken(LineageCoordinator):
        def __init__(self) -> None:  # never built: only its decode hook runs
            pass

        def rows_decoded(self, batch, tokens):
            raise RuntimeError("a bug in rows_decoded")

    monkeypatch.delenv("APC_TEST_FAULTS", raising=False)
    with caplog.at_level(logging.WARNING, logger="server_patch.copyfree"):
        door.rows_decoded(Broken(), object(), [1])
    assert "apc_copyfree decode hook failed: a bug in rows_decoded" in caplog.text
