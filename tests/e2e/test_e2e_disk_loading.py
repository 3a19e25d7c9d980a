"""End to end: a request whose restore point is on disk waits in the queue while its file loads
off the generation thread (issue 29, ``server_patch.integration.loading``).

* While another session streams, a conversation restored from disk (its load held by the
  test's fault hook until the stream has decoded more tokens) answers as a cold prefill, and
  its record says it waited in LOADING for at least those decode steps.
* A file that fails validation, and a load slower than ``APC_DISK_LOAD_WAIT_MS`` (held until
  the request has gone cold), both fall back to a cold prefill with a cold prefill's answer; the
  slow one's file is kept, and a later request restores from it.

One server writes the conversation once (``written``); each restarted server starts on its own
copy of that directory, as a restart on the same directory would find it.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.server_harness import PatchedServer, assert_same_output, reply_text, reply_tokens, text
from tests.e2e.test_e2e_disk import _cold, _env, _files, _send, _stop_gracefully
from tests.fault.test_fault_disk import _flip_tensor_byte
from tests.integration.test_pacing import Stream

TENANT = "disk-suite"  # test_e2e_disk's ``_send`` tenant


def _conversation(tiny_model_dir: Path, disk: Path, log_dir: Path, seed: int) -> list[dict]:
    """A two-turn conversation written to ``disk`` by a first server (its shutdown flush), and
    the third turn's messages, which restore from that file."""
    turn0 = [{"role": "system", "content": text(300, seed)}, {"role": "user", "content": text(200, seed + 1)}]
    first = PatchedServer(tiny_model_dir, env=_env(disk), log_dir=log_dir)
    try:
        first.start()
        a0, _ = _send(first, turn0)
        turn1 = turn0 + [{"role": "assistant", "content": reply_text(a0)},
                         {"role": "user", "content": text(100, seed + 2)}]
        a1, _ = _send(first, turn1)
    finally:
        _stop_gracefully(first)
    assert len(_files(disk)) == 2, _files(disk)  # the conversation entry and the anchor
    return turn1 + [{"role": "assistant", "content": reply_text(a1)},
                    {"role": "user", "content": text(60, seed + 3)}]


class Written(NamedTuple):
    """A disk directory a stopped server wrote a conversation to, and that conversation's next turn."""
    disk: Path
    turn2: list[dict]

    def copy(self, to: Path) -> Path:
        """A directory of one's own holding the same files (the store rebuilds its index from them)."""
        shutil.copytree(self.disk, to)
        assert len(_files(to)) == 2, _files(to)
        return to


@pytest.fixture(scope="module")
def written(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Written:
    root = tmp_path_factory.mktemp("disk-loading-written")
    return Written(root / "lineage-disk", _conversation(tiny_model_dir, root / "lineage-disk", root / "one", 3301))


def _records(server: PatchedServer) -> list[dict[str, Any]]:
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    return body["requests"]


def _stats(server: PatchedServer) -> dict[str, Any]:
    status, body = server.admin("GET", "/status")
    assert status == 200, body
    return body["lineage"]["stats"]


class Chat(threading.Thread):
    """One chat request in the background (its restore line read afterwards)."""

    def __init__(self, server: PatchedServer, messages: list[dict]) -> None:
        super().__init__(daemon=True)
        self.server, self.messages = server, messages
        self.answer: dict[str, Any] | None = None

    def run(self) -> None:
        self.answer, _ = _send(self.server, self.messages)


def _wait_held(hold: Path, server: PatchedServer, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not Path(f"{hold}.held").exists():
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.02)


def streamed_while_held(stream: Any, hold: Path) -> int:
    """The tokens ``stream`` decodes while the work held by ``hold`` waits (until 5 more, or the
    stream ends); then the hold is released."""
    at_hold, give_up = stream.tokens, time.monotonic() + 60  # a guard, not a measure
    while stream.tokens < at_hold + 5 and stream.is_alive() and time.monotonic() < give_up:
        time.sleep(0.02)
    streamed = stream.tokens - at_hold
    hold.unlink()  # the held work goes on
    return streamed


@pytest.mark.server
def test_a_disk_restore_waits_in_the_queue_while_another_stream_decodes(tiny_model_dir: Path, tmp_path: Path,
                                                                       written: Written) -> None:
    disk, hold, turn2 = written.copy(tmp_path / "lineage-disk"), tmp_path / "hold", written.turn2
    hold.write_text("")
    env = _env(disk, APC_TEST_FAULTS="1", APC_TEST_FAULT_DISK_LOAD_HOLD_FILE=str(hold))
    second = PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "two")
    try:
        second.start()
        stream = Stream(second, max_tokens=600)
        stream.start()
        assert stream.decoding.wait(120)
        warm = Chat(second, turn2)
        warm.start()
        _wait_held(hold, second)  # its file is loading, held: the request waits in LOADING
        streamed = streamed_while_held(stream, hold)
        warm.join(300)
        stream.join(300)
        assert streamed >= 5, "the stream stopped decoding while the disk load was held"
        assert warm.answer is not None, second.log_tail()

        line = second.lineage_lines("restore")[-1]
        assert line["kind"] == "disk", line
        (record,) = [r for r in _records(second) if r["restore_kind"] == "disk"]
        # It waited in the queue at least as many decode steps as the stream got tokens meanwhile.
        assert record["loading_steps"] >= streamed, record
        assert record["loading_ms"] > 0, record
        # A request admitted while another row decodes gets no first-token top logprobs from
        # mlx-vlm 0.7.10: its greedy tokens are compared with a cold prefill's.
        cold = _cold(second, turn2)
        assert reply_tokens(warm.answer) == reply_tokens(cold)
    finally:
        hold.unlink(missing_ok=True)
        second.stop()


@pytest.mark.server
def test_a_rejected_file_and_a_load_past_the_bound_fall_back_to_cold(tiny_model_dir: Path, tmp_path: Path,
                                                                     written: Written) -> None:
    # A load slower than the bound: held until the request has gone cold, then released.
    disk, hold, turn2 = written.copy(tmp_path / "slow-disk"), tmp_path / "hold", written.turn2
    hold.write_text("")
    env = _env(disk, APC_TEST_FAULTS="1", APC_TEST_FAULT_DISK_LOAD_HOLD_FILE=str(hold),
               APC_DISK_LOAD_WAIT_MS="200")
    second = PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "two")
    try:
        second.start()
        files = _files(disk)
        late, line = _send(second, turn2)
        _wait_held(hold, second)  # its load started, and is held still
        assert line["kind"] == "cold", line
        (record,) = [r for r in _records(second) if r["prompt_tokens"] == late["usage"]["prompt_tokens"]]
        assert record["loading_ms"] > 0, record  # it waited in LOADING, then went cold
        assert _stats(second).get("disk_rejects", 0) == 0  # a slow file is no bad file
        assert_same_output(late, _cold(second, turn2))
        hold.unlink()  # the held load finishes late: nobody takes it, and the file stays
        assert all(p.exists() for p in files), files
        turn3 = turn2 + [{"role": "assistant", "content": reply_text(late)},
                         {"role": "user", "content": text(30, 3405)}]
        warm, line = _send(second, turn3)
        assert line["kind"] != "cold", line
        assert_same_output(warm, _cold(second, turn3))
    finally:
        hold.unlink(missing_ok=True)
        second.stop()

    # A file that fails validation (bit rot in the conversation entry): cold, the file removed.
    disk = written.copy(tmp_path / "rotten-disk")
    entry_file = max(_files(disk), key=lambda p: p.stat().st_size)
    _flip_tensor_byte(entry_file)
    third = PatchedServer(tiny_model_dir, env=_env(disk, APC_TEST_FAULTS="1"), log_dir=tmp_path / "four")
    try:
        third.start()
        answer, line = _send(third, turn2)
        assert not entry_file.exists(), third.log_tail()
        (record,) = [r for r in _records(third) if r["prompt_tokens"] == answer["usage"]["prompt_tokens"]]
        assert record["loading_ms"] > 0, record
        assert _stats(third).get("disk_rejects", 0) == 1
        assert_same_output(answer, _cold(third, turn2))
    finally:
        third.stop()
