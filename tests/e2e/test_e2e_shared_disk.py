"""End to end: two real servers on loopback share one disk directory (issue 38).

Each writes its own subdirectory (``APC_LINEAGE_DISK_PATH``) and reads the other's
(``APC_SHARED_DISK_PATH``): a conversation served by one continues on the other from the
first one's file, with a cold prefill's answer; another namespace gets nothing from it; a file
its server deletes while the other loads it fails closed (a cold prefill's answer, no error),
and the reader never deletes the writer's files.

Server ``a`` (the writer) is shared by the tests; each test starts its own reader ``b`` after
``a`` wrote what the test needs (joining late is what each proves) and reads only the files it
made ``a`` write (its own seeds and system prompts).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.e2e.test_e2e_disk import TENANT, _cold, _env, _files, _send, _stop_gracefully
from tests.e2e.test_e2e_disk_loading import Chat, _wait_held
from tests.server_harness import PatchedServer, assert_same_output, reply_text, text


def _member(model: Path, shared: Path, name: str, log_dir: Path, **extra: str) -> PatchedServer:
    env = _env(shared / name, APC_SHARED_DISK_PATH=str(shared), APC_SHARED_DISK_SCAN_MS="100", **extra)
    return PatchedServer(model, env=env, log_dir=log_dir / name).start()


@pytest.fixture(scope="module")
def writer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, PatchedServer]]:
    """The shared directory and its member ``a``, one start for the file."""
    root = tmp_path_factory.mktemp("shared-fleet")
    shared = root / "shared"
    a = _member(tiny_model_dir, shared, "a", root)
    try:
        yield shared, a
    finally:
        a.stop()


def _new_files(root: Path, before: set[Path]) -> list[Path]:
    return [p for p in _files(root) if p not in before]


def _disk(server: PatchedServer) -> dict[str, Any]:
    status, body = server.admin("GET", "/status")
    assert status == 200, body
    return body["lineage"]["disk"]


def _wait_peer_files(server: PatchedServer, peer: str, count: int, timeout: float = 120.0) -> None:
    """Until ``server``'s peer index lists ``count`` files of ``peer`` (its own scan thread)."""
    deadline = time.monotonic() + timeout
    while _disk(server)["peers"]["files"].get(peer, 0) != count:
        assert time.monotonic() < deadline, (_disk(server)["peers"], server.log_tail())
        time.sleep(0.05)


def _two_turns(server: PatchedServer, seed: int) -> list[dict]:
    """Two turns on ``server``, flushed to its disk; the third turn's messages."""
    turn0 = [{"role": "system", "content": text(300, seed)}, {"role": "user", "content": text(200, seed + 1)}]
    a0, _ = _send(server, turn0)
    turn1 = turn0 + [{"role": "assistant", "content": reply_text(a0)}, {"role": "user", "content": text(100, seed + 2)}]
    a1, _ = _send(server, turn1)
    status, body = server.admin("POST", "/flush")
    assert status == 200, body
    return turn1 + [{"role": "assistant", "content": reply_text(a1)}, {"role": "user", "content": text(60, seed + 3)}]


@pytest.mark.server
def test_a_session_continues_on_another_server_from_the_first_ones_file(
        tiny_model_dir: Path, tmp_path: Path, writer: tuple[Path, PatchedServer]) -> None:
    shared, a = writer
    b = None
    try:
        before = set(_files(shared / "a"))
        turn2 = _two_turns(a, 3801)
        written = _new_files(shared / "a", before)
        assert len(written) == 2, written  # the conversation entry and the anchor
        b = _member(tiny_model_dir, shared, "b-continues", tmp_path)
        other, line = _send(b, turn2, tenant="another-tenant")  # b's first request loads the model
        assert line["kind"] == "cold", line  # a namespace restores only its own files, on any server
        _wait_peer_files(b, "a", len(_files(shared / "a")))
        warm, line = _send(b, turn2)
        assert line["kind"] == "disk", (line, b.log_tail())
        assert_same_output(warm, _cold(b, turn2))
        assert all(p.exists() for p in written), written  # a peer's files are never removed
        _stop_gracefully(b)  # what b restored is b's now: written to its own subdirectory
        assert len(_files(shared / "b-continues")) >= 1
    finally:
        if b is not None:
            b.stop()


@pytest.mark.server
def test_a_file_its_server_deletes_while_a_peer_loads_it_fails_closed(
        tiny_model_dir: Path, tmp_path: Path, writer: tuple[Path, PatchedServer]) -> None:
    (shared, a), hold = writer, tmp_path / "hold"
    b = None
    try:
        before = set(_files(shared / "a"))
        turn2 = _two_turns(a, 3901)
        entry_file = max(_new_files(shared / "a", before), key=lambda p: p.stat().st_size)
        hold.write_text("")
        b = _member(tiny_model_dir, shared, "b-vanished", tmp_path, APC_TEST_FAULTS="1",
                    APC_TEST_FAULT_DISK_LOAD_HOLD_FILE=str(hold))
        _cold(b, turn2[:2])  # b's first request loads the model (another namespace: nothing to load)
        _wait_peer_files(b, "a", len(_files(shared / "a")))
        chat = Chat(b, turn2)
        chat.start()
        _wait_held(hold, b)  # b's load of a's file has begun, held before it opens the file
        status, body = a.admin("DELETE", f"/entries/{entry_file.stem}")
        assert status == 200, body
        assert not entry_file.exists()  # a evicted it: the file b is loading is gone
        hold.unlink()
        chat.join(300)
        assert chat.answer is not None, b.log_tail()
        assert _disk(b)["rejects"].get("peer_vanished") == 1, _disk(b)
        assert_same_output(chat.answer, _cold(b, turn2))
        assert "Traceback" not in b.log_text()
    finally:
        hold.unlink(missing_ok=True)
        if b is not None:
            b.stop()


@pytest.mark.server
def test_a_server_joining_the_fleet_restores_the_anchor_a_peer_pinned(
        tiny_model_dir: Path, tmp_path: Path, writer: tuple[Path, PatchedServer]) -> None:
    shared, a = writer
    system = text(400, 4001)
    b = None
    try:
        status, body = a.admin("POST", "/anchors", {"system": system, "tenant": TENANT})
        assert status == 200, body
        status, body = a.admin("POST", "/flush")
        assert status == 200, body
        b = _member(tiny_model_dir, shared, "b-joins", tmp_path)  # joins the fleet after the pin
        _cold(b, [{"role": "user", "content": text(20, 4002)}])  # its first request loads the model
        _wait_peer_files(b, "a", len(_files(shared / "a")))
        session = [{"role": "system", "content": system}, {"role": "user", "content": text(80, 4003)}]
        answer, line = _send(b, session)
        assert line["kind"] == "disk", (line, b.log_tail())  # a's pinned anchor, read from a's file
        assert_same_output(answer, _cold(b, session))
        status, anchors = b.admin("GET", "/anchors")
        assert status == 200, anchors
        assert any(x["pinned"] for x in anchors["anchors"]), anchors  # pinned here too, as on its peer
    finally:
        if b is not None:
            b.stop()
