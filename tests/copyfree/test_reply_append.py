"""A row that shared a decoding batch ends: only the rows its entry lacks are copied (issue 29).

The row's prompt-end entry was adopted at its join (its own buffer, spare rows included), so
its commit past the reply writes prompt end .. reply end into those spare rows instead of
copying the whole row out of the shared buffer. The copy ledger counts the bytes at that site;
the entry then answers as a cold prefill of prompt + reply does, and the next turn is still lent
the buffer. Driven as test_row_machine.py drives the real coordinator: fake batches over the
kilobyte model's real caches.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.fake_model import prefill, random_tokens
from server_patch.observe import ledger
from server_patch.copyfree import merge as copyfree_merge
from server_patch.copyfree.counter import _address
from server_patch.integration.session import SessionState
from tests.integration.test_row_machine import Batch, admit, prefill_and_store, server  # noqa: F401 (the fixture)

PROMPT, REPLY = 40, 6


@pytest.fixture
def counted(monkeypatch):
    """The process's copy ledger, counting for this test only."""
    monkeypatch.setattr(ledger.LEDGER, "_on", True)
    ledger.reset()
    yield ledger
    ledger.reset()


def per_token_kv_bytes(kv) -> int:
    """Bytes of one token's rows in every float KV buffer of a handle."""
    return sum(int(v.nbytes) // int(v.shape[2]) for layer in kv.layers for child in layer
               for k, v in child.items() if k in ("keys", "values"))


def latent_keys(kv):
    return next(child["keys"] for layer in kv.layers for child in layer if "keys" in child)


def joined_and_decoded(s, prompt: np.ndarray, reply: np.ndarray):
    """Row 1 prefills alone, joins a decoding row 7 (its buffer adopted at its prompt end),
    then the two decode ``reply`` (row 1's ids) in one shared batch."""
    caches, lengths = admit(s, 1, prompt)
    prefill_and_store(s, 1, prompt, caches, lengths)
    other = s.model.make_cache()
    prefill(s.model, other, random_tokens(PROMPT, seed=31))
    s.coordinator.batches_joining(Batch(uids=[7], prompt_cache=other, _num_tokens=[3]), s.generator._prompt_batch)
    (entry,) = s.cache.entries()
    assert entry.length == PROMPT - 1 and entry.kv.capacity() > PROMPT + REPLY  # adopted, spare rows kept
    shared = copyfree_merge.merge_rows([other, caches], [PROMPT, PROMPT], [0, 0], reserve=0)  # extend's concat
    s.generator._prompt_batch = None
    del caches  # the join replaced the lone batch: the entry is its buffer's only holder now
    batch = Batch(uids=[7, 1], prompt_cache=shared, _num_tokens=[3, 0])
    s.generator._generation_batch = batch
    for token in reply:
        mx.eval(s.model(mx.array([[5], [int(token)]]), cache=shared).logits)
        batch._num_tokens[1] += 1
        s.coordinator.rows_decoded(batch, [5, int(token)])
    s.disk.land()  # its prompt-end entry was queued for writing: written, so its buffer may be taken
    return entry, batch


def test_a_shared_rows_reply_commit_copies_only_the_rows_its_entry_lacks(server, counted):
    prompt, reply = random_tokens(PROMPT, seed=32), random_tokens(REPLY, seed=33)
    entry, batch = joined_and_decoded(server, prompt, reply)
    per_token, buffer = per_token_kv_bytes(entry.kv), _address(latent_keys(entry.kv))
    ledger.reset()
    server.coordinator.rows_leaving(batch, [0])  # row 1 ends; row 7 decodes on
    (new,) = server.cache.entries()
    assert new.length == PROMPT + REPLY and new.prompt_end == PROMPT - 1 and not server.cache.holds(entry)
    copies = ledger.snapshot()
    appended = PROMPT + REPLY - (PROMPT - 1)  # the last prompt token and the reply
    assert copies["reply_append.kv"] == appended * per_token, copies
    assert "extract.kv" not in copies and "merge.kv" not in copies, copies
    assert server.cache.stats["reply_appends"] == 1 and server.cache.stats["reply_row_copies"] == 0
    assert _address(latent_keys(new.kv)) == buffer, "the rows were not written into the adopted buffer"
    # The entry answers as a cold prefill of prompt + reply does.
    follow = random_tokens(3, seed=34)
    warm = prefill(server.model, server.coordinator.lineage.runtime.layout.build(new.kv, new.head, new.length),
                   follow)
    cold = prefill(server.model, server.model.make_cache(), np.concatenate([prompt, reply, follow]))
    assert mx.allclose(warm, cold, atol=1e-4).item()
    # And the next turn is lent the buffer.
    server.generator._generation_batch = None
    admit(server, 2, np.concatenate([prompt, reply, random_tokens(12, seed=35)]))
    turn = server.book.by_uid(2)
    assert turn.record.kv_admission == "lent" and turn.loan is not None and new.lent


def test_without_room_in_its_entrys_buffer_the_row_is_copied_and_counted(server, counted, monkeypatch):
    prompt, reply = random_tokens(PROMPT, seed=36), random_tokens(REPLY, seed=37)
    entry, batch = joined_and_decoded(server, prompt, reply)
    rows = entry.kv.capacity()
    monkeypatch.setattr(type(entry.kv), "capacity", lambda self, key="keys": PROMPT)  # no room for the reply
    ledger.reset()
    server.coordinator.rows_leaving(batch, [0])
    monkeypatch.undo()
    (new,) = server.cache.entries()
    assert new.length == PROMPT + REPLY and not server.cache.holds(entry)
    copies = ledger.snapshot()
    assert "reply_append.kv" not in copies and copies["extract.kv"] >= (PROMPT + REPLY) * per_token_kv_bytes(new.kv)
    assert server.cache.stats["reply_row_copies"] == 1 and new.kv.capacity() < rows


def test_warm_rows_sharing_a_prompt_batch_append_their_suffix_and_reply_to_the_entries_they_restored(server,
                                                                                                   counted):
    """Two conversations' next turns are admitted together: each row restored at its entry's
    head (the merge copied those rows), so at its end only its prompt suffix and reply are
    written into that entry's buffer."""
    s = server
    firsts = [random_tokens(PROMPT, seed=41 + i) for i in range(2)]
    for uid, prompt in ((1, firsts[0]), (2, firsts[1])):
        serve_one(s, uid, prompt, random_tokens(REPLY, seed=uid))
    entries = {e.length: e for e in s.cache.entries()}
    assert len(s.cache.entries()) == 2
    turns = [np.concatenate([f, random_tokens(REPLY, seed=uid), random_tokens(10, seed=50 + uid)])
             for uid, f in zip((1, 2), firsts)]
    olds = {id(e) for e in s.cache.entries()}
    hits = []
    for t in turns:
        hits.append(s.coordinator.lookup(t, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                                         prefix_has_media=lambda n: False))
        assert s.coordinator.checkpoint_lengths(t, set())[-1] == len(t) - 1
    assert all(h is not None and h["prefix_len"] == PROMPT + REPLY for h in hits), hits
    shared, _ = s.coordinator.merge_rows(hits, [h["prefix_len"] for h in hits])
    s.coordinator.bind_rows([3, 4], [{"full_input_ids": [int(x) for x in t], "extra_hash": 0} for t in turns])
    done = PROMPT + REPLY
    n = len(turns[0])
    mx.eval(s.model(mx.array(np.stack([t[done:n - 1] for t in turns])), cache=shared).logits)
    for i, t in enumerate(turns):
        s.coordinator.store_checkpoint(t[:n - 1], shared, extra_hash=0, batch_idx=i, uid=3 + i)
    rows = [s.book.by_uid(3), s.book.by_uid(4)]
    assert [r.state for r in rows] == [SessionState.DECODING] * 2, [(r.state, r.history) for r in rows]
    assert all(r.deferral is not None and r.deferral.shared for r in rows)
    batch = Batch(uids=[3, 4], prompt_cache=shared, _num_tokens=[0, 0])
    s.generator._prompt_batch, s.generator._generation_batch = None, batch
    last = [int(t[n - 1]) for t in turns]
    replies = [random_tokens(REPLY, seed=60 + i) for i in range(2)]
    mx.eval(s.model(mx.array([[x] for x in last]), cache=shared).logits)  # the last prompt token
    for step in range(REPLY):
        ids = [int(r[step]) for r in replies]
        mx.eval(s.model(mx.array([[x] for x in ids]), cache=shared).logits)
        batch._num_tokens[0] += 1
        batch._num_tokens[1] += 1
        s.coordinator.rows_decoded(batch, ids)
    s.disk.land()
    per_token = per_token_kv_bytes(next(iter(entries.values())).kv)
    ledger.reset()
    s.coordinator.rows_leaving(batch, [])
    copies = ledger.snapshot()
    appended = 2 * (n + REPLY - done)  # each row: its prompt suffix and its reply
    assert copies["reply_append.kv"] == appended * per_token, copies
    assert "extract.kv" not in copies, copies
    news = s.cache.entries()
    assert len(news) == 2 and not olds & {id(e) for e in news}  # each old entry absorbed
    for turn, reply in zip(turns, replies):
        (new,) = [e for e in news if np.array_equal(e.tokens, np.concatenate([turn, reply]))]
        follow = random_tokens(3, seed=70)
        warm = prefill(s.model, s.coordinator.lineage.runtime.layout.build(new.kv, new.head, new.length), follow)
        cold = prefill(s.model, s.model.make_cache(), np.concatenate([turn, reply, follow]))
        assert mx.allclose(warm, cold, atol=1e-4).item()


def serve_one(s, uid, prompt, reply):
    from tests.integration.test_row_machine import serve_turn

    serve_turn(s, uid, prompt, reply)
    s.disk.land()
