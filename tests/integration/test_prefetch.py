"""Prefetch, and no disk load on the generation thread at the lookup, fast (``integration.loading``).

* ``prefetch`` runs every step, admitting or not: a queued prompt's disk load starts while the
  batch is full (``admissible`` is not reached then), each queued prompt is looked ahead once,
  and a prompt that leaves the queue ends its waiting row.
* A lookup whose plan turns to a disk file nobody loaded ahead never loads it: the file this
  request did load is promoted and the lookup plans from RAM alone (``flow.NOT_AHEAD``).

The real ``LineageCache``, ``SessionBook``, ``BackgroundLoads`` and ``Admission`` of
test_row_loading.py's fixture (a gated stand-in disk); states and counts, never times. One
real-server test: with the batch full (25 decoding streams), a conversation restored from disk
starts its load (held by the fault hook) before any stream ends, and answers as a cold prefill
(the streams stopped once the load started: their rows leave, it is admitted).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from server_patch.integration.loading import PREFETCHED
from server_patch.integration.pending import request_key
from server_patch.integration.session import SessionState
from server_patch.lineage import DISK, LineageCache, as_tokens
from server_patch.lineage.flow import NOT_AHEAD
from server_patch.lineage.misses import Lost
from tests.e2e.test_e2e_disk import _cold, _env, _files, _send
from tests.e2e.test_e2e_disk_loading import Chat, _records, _stats, _wait_held
from tests.integration.test_pacing import Stream, stop_streams
from tests.integration.test_row_loading import lookup, on_disk_only, prompt_of, queue_of, s, until_ready  # noqa: F401
from tests.lineage.test_lineage_policy import serve, words
from tests.server_harness import ADMIN_TOKEN, PatchedServer, reply_text, reply_tokens, text

LOADING, ENDED = SessionState.LOADING, SessionState.ENDED


def counting_lookups(cache: LineageCache) -> list[int]:
    """Every look-ahead and lookup of ``cache`` appends the prompt's length."""
    calls: list[int] = []
    lookup_of = cache.lookup

    def counted(tokens, *args, **kwargs):
        calls.append(len(tokens))
        return lookup_of(tokens, *args, **kwargs)

    cache.lookup = counted
    return calls


def test_a_queued_prompts_disk_load_starts_while_the_batch_is_full(s):
    calls, counted = counting_lookups(s.cache), s.cache.stats["lookups"]
    queue = queue_of(s.cold, s.warm)  # mlx-vlm's queue, which it does not admit from this step
    s.loads.prefetch(queue, prompt_of, 8, blocked=True)
    row = s.book.by_key(request_key("", s.warm))
    assert row.state == LOADING and row.load.record.id == s.entry.id
    assert s.book.by_key(request_key("", s.cold)) is None  # a cold prompt has nothing to fetch
    assert s.cache.stats[PREFETCHED] == 1 and s.cache.stats["lookups"] == counted  # no lookup counted
    s.disk.gate.set()
    for _ in range(2000):  # later steps, still not admitting: the load is polled, never looked up again
        s.loads.prefetch(queue, prompt_of, 8, blocked=True)
        if row.load.done:
            break
    assert row.load.done and row.load.answer[0] is not None
    assert calls == [len(s.cold), len(s.warm)]  # one look-ahead per queued prompt, however many steps
    assert s.loads.admissible(queue, prompt_of, 8) == 2  # the batch has room again: both admissible
    admission = lookup(s, s.warm, uid=1)  # second in the queue
    assert admission.tier == DISK and s.disk.loaded == [s.entry.id]


def test_prefetch_looks_at_only_the_first_queued_prompts_and_ends_a_row_that_leaves(s):
    queue = queue_of(*[as_tokens(words(30, 4300 + i)) for i in range(3)], s.warm)
    s.loads.prefetch(queue, prompt_of, 8)
    assert s.book.by_key(request_key("", s.warm)) is None  # fourth in the queue: not yet
    s.loads.prefetch(queue[3:], prompt_of, 8)  # the others were admitted: now it is first
    row = s.book.by_key(request_key("", s.warm))
    assert row.state == LOADING
    s.loads.prefetch([], prompt_of, 8)  # cancelled while its file loads
    assert row.state == ENDED and row.load is None
    s.disk.gate.set()


def test_a_disk_plan_nobody_loaded_ahead_is_not_loaded_at_the_lookup(s):
    admission = lookup(s, s.warm)  # its look-ahead saw no file; the lookup's plan is one
    assert s.disk.loaded == []  # nothing loaded on the generation thread
    assert not admission.plan.hit and (799, Lost.DISK_UNUSED) in admission.steps
    assert admission.detail == NOT_AHEAD
    assert s.cache.lookup(s.warm).tier == DISK  # the file is kept for a later request


def test_a_plan_that_turns_to_another_file_restores_the_file_it_loaded():
    base = words(800, 4400)
    t = on_disk_only(base)
    cache, disk, shorter = t.cache, t.disk, t.entry
    prompt = as_tokens(base + words(300, 4401) + words(20, 4402))
    disk.gate.set()
    until_ready(t, queue_of(prompt))  # its look-ahead loaded the shorter file
    longer = serve(cache, list(prompt[:1100]))[2]  # meanwhile a longer file lands on disk
    cache.flush()
    cache.drop(longer.id, "test")
    assert cache.lookup(prompt).record.id == longer.id
    admission = lookup(t, prompt)
    assert disk.loaded == [shorter.id]  # the longer file was never loaded at the lookup
    assert admission.plan.hit and admission.plan.entry.id == shorter.id and admission.tier == DISK
    assert (longer.length, Lost.DISK_UNUSED) in admission.steps and admission.detail == NOT_AHEAD


FULL = 25  # decoding rows past which mlx-vlm 0.7.10 admits nothing (32 rows, prompt batches of 8)


def _on_disk_only(server: PatchedServer, disk: Path, seed: int) -> list[dict]:
    """Two turns of a conversation on ``server``, written to its disk tier (``POST /admin/flush``)
    and dropped from RAM (``POST /v1/cache/reset``: the files stay); the third turn's messages,
    which restore from its file (no first server and shutdown flush to start and stop)."""
    turn = [{"role": "system", "content": text(300, seed)}, {"role": "user", "content": text(200, seed + 1)}]
    for count, next_seed in ((100, seed + 2), (60, seed + 3)):
        answer, _ = _send(server, turn)
        turn = turn + [{"role": "assistant", "content": reply_text(answer)},
                       {"role": "user", "content": text(count, next_seed)}]
    status, flushed = server.admin("POST", "/flush", {"timeout": 60})
    assert status == 200 and flushed["complete"], flushed
    assert len(_files(disk)) == 2, _files(disk)  # the conversation entry and the anchor
    status, body = server.request("POST", "/v1/cache/reset", {}, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert status == 200, body
    assert server.admin("GET", "/entries?tier=ram")[1]["entries"] == []
    return turn


@pytest.mark.server
def test_a_disk_restore_starts_loading_while_the_batch_is_full(tiny_model_dir: Path, tmp_path: Path) -> None:
    disk, hold = tmp_path / "lineage-disk", tmp_path / "hold"
    env = _env(disk, APC_TEST_FAULTS="1", APC_TEST_FAULT_DISK_LOAD_HOLD_FILE=str(hold))
    server = PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "two")
    try:
        server.start()
        turn2 = _on_disk_only(server, disk, 3701)
        hold.write_text("")
        streams = [Stream(server, max_tokens=400, seed=3710 + i) for i in range(FULL)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.decoding.wait(300)  # all decoding: the batch admits nothing now
        warm = Chat(server, turn2)
        warm.start()
        _wait_held(hold, server)  # its load started (and is held) while the batch was full
        running = sum(stream.is_alive() for stream in streams)
        hold.unlink()
        # They kept the batch full until the load started: that is all they were for. Stopped,
        # their rows leave and the restored conversation is admitted now, not after 400 tokens.
        stop_streams(server, *streams)
        warm.join(300)
        assert running == FULL, "a stream ended before the load started: the batch had room"
        assert warm.answer is not None, server.log_tail()
        assert _stats(server).get(PREFETCHED, 0) >= 1
        (record,) = [r for r in _records(server) if r["restore_kind"] == "disk"]
        assert record["loading_ms"] > 0, record
        assert reply_tokens(warm.answer) == reply_tokens(_cold(server, turn2))
    finally:
        hold.unlink(missing_ok=True)
        server.stop()
