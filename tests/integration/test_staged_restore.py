"""Staged restores, fast: a queued prompt whose RAM restore the merge would copy on the
generation thread waits in STAGING while the copy is made on the stager thread
(``integration.staging``), and the merge then adopts it.

The real coordinator over a real ``LineageCache`` and the kilobyte model's caches (the row
machine's light runtime, ``test_row_machine.light_server``) with lending off, so every warm
turn is one the merge would copy. The copy is held by the test's fault hook while the "other
stream" decodes; every assertion is on states, counts and logits, never on times. One
real-server test: an edited last message (a checkpoint restore below the entry's head) stages
while another stream decodes, answers as a cold prefill, and the copy counter sees a staged
copy and no merge copy.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from server_patch.observe import ledger
from server_patch.integration import staging
from server_patch.integration.pending import request_key
from server_patch.integration.session import SessionState
from server_patch.lineage import as_tokens
from tests.e2e.test_e2e_disk import _cold, _send
from tests.e2e.test_e2e_disk_loading import Chat, _records, _wait_held, streamed_while_held
from tests.fake_model import prefill, random_tokens
from tests.integration.test_pacing import Stream
from tests.integration.test_row_loading import GatedDisk
from tests.integration.test_row_machine import admit, light_server, serve_turn
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)
from tests.server_harness import PatchedServer, reply_text, reply_tokens, text

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

STAGING, ADMITTED, PREFILLING = SessionState.STAGING, SessionState.ADMITTED, SessionState.PREFILLING


@pytest.fixture
def s(model, layout, monkeypatch, tmp_path):
    """A light server whose warm turns all take the merge copy (no lending), staging any restore
    of 8 tokens or more, with the copy ledger counting; ``s.hold``: the stager's hold file."""
    server = light_server(model, layout, monkeypatch, APC_COPYFREE_LEND="0", APC_STAGE_MIN_TOKENS="8",
                          APC_TEST_FAULTS="1", APC_TEST_FAULT_STAGE_HOLD_FILE=str(tmp_path / "hold"))
    monkeypatch.setattr(ledger.LEDGER, "_on", True)  # counted during this test only
    server.hold = tmp_path / "hold"
    prompt, reply = random_tokens(40, seed=21), random_tokens(6, seed=22)
    serve_turn(server, 1, prompt, reply)
    (server.entry,) = server.cache.entries()
    server.disk.land()  # nothing is being written: the entry may take a receipt
    server.turn = np.concatenate([prompt, reply, random_tokens(12, seed=23)])
    return server


def queued(tokens: np.ndarray, uid: int) -> list[tuple]:
    """mlx-vlm's queued sequence: (uid, ids, max_tokens, prompt_kwargs, processors, criteria)."""
    return [(uid, [int(t) for t in tokens], 8, {}, None, None)]


def admissible(s, queue: list, decoding: int = 1) -> int:
    return s.coordinator.admissible(queue, lambda kwargs: 0, 8, decoding=decoding)


def row_of(s, tokens: np.ndarray):
    return s.book.by_key(request_key("0", as_tokens(tokens)))


def copied(before: dict, op: str) -> int:
    return ledger.since(before).get(f"{op}.kv", 0)


def settle_stager(s) -> None:
    """Until the runtime's stager has nothing running (a bound, not a measure)."""
    for _ in range(6000):
        if s.coordinator.lineage.runtime.stages.pending() == 0:
            return
        time.sleep(0.005)
    raise AssertionError("the staged copy never finished")


def warm_and_cold(s, uid: int) -> tuple[mx.array, mx.array, object]:
    """The turn admitted now (lookup, merge, bind) and prefilled: its logits, a cold prefill's,
    and its row."""
    caches, _ = admit(s, uid, s.turn)
    row = s.book.by_uid(uid)
    warm = prefill(s.model, caches, s.turn[row.record.restored_tokens:])
    return warm, prefill(s.model, s.model.make_cache(), s.turn), row


def test_a_restore_the_merge_would_copy_stages_while_others_decode_and_the_merge_copies_nothing(s):
    s.hold.write_text("")
    queue = queued(s.turn, 2)
    before = ledger.snapshot()
    assert admissible(s, queue) == 0  # staging: it waits in the queue
    row = row_of(s, s.turn)
    assert row.state == STAGING and s.entry.lent  # the entry holds a receipt while it is read
    for _ in range(200):
        if Path(f"{s.hold}.held").exists():
            break
        time.sleep(0.01)
    for step in range(3):  # the batch goes on decoding meanwhile
        s.book.decoded([99], [step])
        assert admissible(s, queue) == 0 and row.state == STAGING
    s.hold.unlink()
    settle_stager(s)
    assert admissible(s, queue) == 1
    assert not s.entry.lent and s.entry.loans == 0  # the receipt ended with the copy
    assert copied(before, "stage") > 0
    merged = ledger.snapshot()
    warm, cold, row = warm_and_cold(s, 2)
    assert row.history == [STAGING, ADMITTED] and row.state == PREFILLING
    assert row.record.kv_admission == "staged" and row.record.loading_steps == 3
    assert copied(merged, "merge") == 0  # adopted: no copy on the generation thread
    assert s.cache.stats["kv_staged"] == 1
    assert mx.allclose(warm, cold, atol=1e-4).item()  # warm equals cold


def test_with_nothing_decoding_or_below_the_threshold_the_merge_copies_as_before(s, monkeypatch):
    queue = queued(s.turn, 2)
    assert admissible(s, queue, decoding=0) == 1 and row_of(s, s.turn) is None  # nobody would wait
    monkeypatch.setenv("APC_STAGE_MIN_TOKENS", str(len(s.turn)))
    assert admissible(s, queue) == 1 and row_of(s, s.turn) is None
    before = ledger.snapshot()
    warm, cold, row = warm_and_cold(s, 2)
    assert row.record.kv_admission == "copied" and copied(before, "merge") > 0
    assert mx.allclose(warm, cold, atol=1e-4).item()


def test_a_staged_prompt_is_admitted_alone_in_its_prompt_batch(s):
    other = random_tokens(30, seed=24)
    queue = queued(other, 3) + queued(s.turn, 2)
    assert admissible(s, queue) == 1 and [q[0] for q in queue] == [3, 2]  # the staging one behind
    settle_stager(s)
    assert admissible(s, queued(other, 3) + queued(s.turn, 2)) == 1  # the prompt before it, alone
    assert admissible(s, queued(s.turn, 2) + queued(other, 3)) == 1  # then the staged one, alone


def test_a_failed_copy_falls_back_to_the_merge(s, monkeypatch):
    def broken(*args, **kwargs):
        raise MemoryError("no room for the staged copy")

    monkeypatch.setattr(staging, "stage_rows", broken)
    queue = queued(s.turn, 2)
    assert admissible(s, queue) == 0
    settle_stager(s)
    assert admissible(s, queue) == 1 and s.entry.loans == 0
    before = ledger.snapshot()
    warm, cold, row = warm_and_cold(s, 2)
    assert row.record.kv_admission == "copied" and copied(before, "merge") > 0
    assert mx.allclose(warm, cold, atol=1e-4).item()


def test_a_copy_past_the_bound_is_dropped_and_its_receipt_ends(s, monkeypatch):
    s.hold.write_text("")
    monkeypatch.setenv("APC_DISK_LOAD_WAIT_MS", "0")
    queue = queued(s.turn, 2)
    assert admissible(s, queue) == 1  # started, and already past the bound
    assert row_of(s, s.turn).stage.why == staging.LATE and s.entry.loans == 0
    s.hold.unlink()
    settle_stager(s)
    before = ledger.snapshot()
    warm, cold, row = warm_and_cold(s, 2)
    assert row.record.kv_admission == "copied" and copied(before, "merge") > 0
    assert mx.allclose(warm, cold, atol=1e-4).item()


def test_an_entry_gone_before_the_lookup_falls_back_and_a_cancelled_one_ends_its_row(s):
    queue = queued(s.turn, 2)
    assert admissible(s, queue) == 0
    settle_stager(s)
    assert admissible(s, queue) == 1
    assert s.cache.drop(s.entry.id, "test")  # the entry left RAM after its rows were staged
    caches, _ = admit(s, 2, s.turn)
    row = s.book.by_uid(2)
    assert row.record.kv_admission == "" and row.record.restored_tokens == 0  # cold, never the copy
    # A prompt that leaves the queue while staging: its row ends, the receipt with it.
    serve_turn(s, 4, s.turn, random_tokens(4, seed=25))
    (entry,) = s.cache.entries()
    s.disk.land()
    branch = np.concatenate([s.turn, random_tokens(9, seed=26)])
    s.hold.write_text("")
    assert admissible(s, queued(branch, 5)) == 0 and entry.lent
    waiting = row_of(s, branch)
    assert admissible(s, []) == 0  # it left the queue
    assert waiting.state == SessionState.ENDED and not entry.lent
    s.hold.unlink()
    settle_stager(s)


def _copies(path: Path) -> dict[str, int]:
    """The copy counter's totals (``APC_COPY_COUNTER_FILE``), by ``op.kind``."""
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.server
def test_a_branch_restore_stages_while_another_stream_decodes_and_answers_as_cold(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    hold, counter = tmp_path / "hold", tmp_path / "copies.json"
    env = {"TOP_LOGPROBS_K": "5", "APC_STAGE_MIN_TOKENS": "64", "APC_TEST_FAULTS": "1",
           "APC_TEST_FAULT_STAGE_HOLD_FILE": str(hold), "APC_COPY_COUNTER": "1",
           "APC_COPY_COUNTER_FILE": str(counter)}
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "log") as server:
        turn0 = [{"role": "system", "content": text(300, 3601)}, {"role": "user", "content": text(200, 3602)}]
        a0, _ = _send(server, turn0)
        turn1 = turn0 + [{"role": "assistant", "content": reply_text(a0)},
                         {"role": "user", "content": text(100, 3603)}]
        _send(server, turn1)
        # An edit of the last message: it restores at a checkpoint below the entry's head, which
        # the entry cannot lend (its head is past it): the merge would copy it.
        branch = turn1[:-1] + [{"role": "user", "content": text(100, 3604)}]
        hold.write_text("")
        stream = Stream(server, max_tokens=600)
        stream.start()
        assert stream.decoding.wait(120)
        before = _copies(counter)
        warm = Chat(server, branch)
        warm.start()
        _wait_held(hold, server)  # its copy is staging, held: the request waits in STAGING
        streamed = streamed_while_held(stream, hold)
        warm.join(300)
        stream.join(300)
        assert streamed >= 5, "the stream stopped decoding while the copy was staged"
        assert warm.answer is not None, server.log_tail()
        after = _copies(counter)
        (record,) = [r for r in _records(server) if r["kv_admission"] == "staged"]
        assert record["loading_steps"] >= streamed, record
        staged = after.get("stage.kv", 0) - before.get("stage.kv", 0)
        merged = after.get("merge.kv", 0) - before.get("merge.kv", 0)
        # The merge copied less than was staged: not the staged rows (only the small pooled
        # windows the stock merges copy); a merge copy of the row would be at least as large.
        assert staged > 0 and merged < staged, (before, after)
        assert reply_tokens(warm.answer) == reply_tokens(_cold(server, branch))


def test_a_file_loaded_while_others_decode_has_its_merge_copy_staged_too(s):
    """A restore from disk: the file's buffers have no room to be lent, so once its load is done
    (off the thread) the entry is promoted and the merge copy staged as well (LOADING ->
    STAGING): neither the load nor the copy runs on the generation thread."""
    disk = GatedDisk()
    disk.answers[s.entry.id] = (s.entry, "")
    s.cache.flush()
    s.disk.land()
    s.cache.clear()  # RAM forgets; the disk remembers
    s.coordinator.lineage.runtime.disk = disk
    queue = queued(s.turn, 2)
    before = ledger.snapshot()
    assert admissible(s, queue) == 0
    row = row_of(s, s.turn)
    assert row.state == SessionState.LOADING
    s.book.decoded([99], [0])
    disk.gate.set()
    for _ in range(2000):
        if row.state == STAGING:
            break
        assert admissible(s, queue) == 0  # still waiting: loading, then staging
        time.sleep(0.005)
    assert row.state == STAGING and s.cache.holds(s.entry)  # promoted while it queued
    settle_stager(s)
    assert admissible(s, queue) == 1
    merged = ledger.snapshot()
    warm, cold, row = warm_and_cold(s, 2)
    assert row.history == [SessionState.LOADING, STAGING, ADMITTED]
    assert disk.loaded == [s.entry.id] and row.record.restore_kind == "disk"  # a disk restore still
    assert row.record.kv_admission == "staged" and row.record.loading_steps == 1
    assert copied(before, "stage") > 0 and copied(merged, "merge") == 0
    assert mx.allclose(warm, cold, atol=1e-4).item()  # warm equals cold
