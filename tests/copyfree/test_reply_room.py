"""A reply with room (issue 29): where a shared row's prompt end is copied, room is left for its reply.

A cold row of a shared prompt batch has no entry whose buffer its reply could be appended to,
and a deferred row a lookup surfaces is copied out at that moment. Both copies are made into
buffers with room for the request's ``max_tokens`` (bounded, rounded to the merge's buckets),
so when the row ends only its reply rows are written (``reply_append``), never the whole row;
the RAM budget counts the buffer as it is, room included. Driven as test_row_machine.py drives
the real coordinator: fake batches over the kilobyte model's real caches.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.copyfree.test_reply_append import counted, latent_keys, per_token_kv_bytes  # noqa: F401 (fixture)
from tests.fake_model import prefill, random_tokens
from tests.integration.test_row_machine import Batch, admit, meta, prefill_and_store, server  # noqa: F401
from server_patch.copyfree import pool
from server_patch.observe import ledger
from server_patch.copyfree import merge as copyfree_merge
from server_patch.copyfree.append import reply_capacity
from server_patch.copyfree.counter import _address
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.integration.session import SessionState

PROMPT, REPLY = 40, 6
MAX_TOKENS = [REPLY + 2, 1000]  # row 1's limit, row 2's: what each row's room is sized for


def cold_pair(s, prompts: list[np.ndarray]) -> Batch:
    """Two cold prompts prefilled in one batch (mlx-vlm's shared prompt batch), stored at their
    prompt ends, the batch decoding; rows 1 and 2."""
    coordinator = s.coordinator
    for prompt in prompts:
        assert coordinator.lookup(prompt, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                                  prefix_has_media=lambda n: False) is None
        assert coordinator.checkpoint_lengths(prompt, set())[-1] == PROMPT - 1
    coordinator.bind_rows([1, 2], [meta(p) for p in prompts])
    shared = copyfree_merge.merge_rows([s.model.make_cache(), s.model.make_cache()], [0, 0], [PROMPT, PROMPT],
                                       reserve=REPLY + 1)
    batch = Batch(uids=[1, 2], prompt_cache=shared, _num_tokens=[0, 0], max_tokens=list(MAX_TOKENS))
    s.generator._prompt_batch = batch
    mx.eval(s.model(mx.array(np.stack([p[:-1] for p in prompts])), cache=shared).logits)
    for i, prompt in enumerate(prompts):
        coordinator.store_checkpoint(prompt[:-1], shared, extra_hash=0, batch_idx=i, uid=i + 1)
    s.generator._prompt_batch, s.generator._generation_batch = None, batch
    mx.eval(s.model(mx.array([[int(p[-1])] for p in prompts]), cache=shared).logits)  # the last prompt token
    return batch


def decode_both(s, batch: Batch, replies: list[np.ndarray]) -> None:
    for step in range(REPLY):
        ids = [int(r[step]) for r in replies]
        mx.eval(s.model(mx.array([[x] for x in ids]), cache=batch.prompt_cache).logits)
        batch._num_tokens[0] += 1
        batch._num_tokens[1] += 1
        s.coordinator.rows_decoded(batch, ids)


def settings() -> CopyFreeSettings:
    return pool.settings()


def test_a_cold_row_of_a_shared_batch_appends_only_its_reply_rows_when_it_ends(server, counted):
    s = server
    prompts = [random_tokens(PROMPT, seed=101), random_tokens(PROMPT, seed=102)]
    replies = [random_tokens(REPLY, seed=103), random_tokens(REPLY, seed=104)]
    batch = cold_pair(s, prompts)
    rows = [s.book.by_uid(1), s.book.by_uid(2)]
    assert [r.state for r in rows] == [SessionState.DECODING] * 2 and all(r.deferral is None for r in rows)
    entries = {int(e.tokens[0]): e for e in s.cache.entries()}
    first, second = entries[int(prompts[0][0])], entries[int(prompts[1][0])]
    # Copied out at the prefill end with room sized by each row's own max_tokens, and counted
    # in the RAM budget at the buffer's size, room included.
    for entry, limit in ((first, MAX_TOKENS[0]), (second, MAX_TOKENS[1])):
        room = reply_capacity(settings(), PROMPT - 1, PROMPT, limit)
        assert entry.kv.capacity() == room > PROMPT + limit, (entry.kv.capacity(), room)
        assert entry.kv.held_nbytes - entry.kv.nbytes == (room - (PROMPT - 1)) * per_token_kv_bytes(entry.kv)
        assert entry.nbytes == entry.kv.held_nbytes + entry.head.nbytes + entry.checkpoint_bytes
    assert first.kv.capacity() < second.kv.capacity()  # max_tokens sized them
    assert s.cache.ram_bytes == sum(e.nbytes for e in s.cache.entries())
    decode_both(s, batch, replies)
    s.disk.land()  # the prompt-end entries were queued for writing: written, so their buffers may be taken
    per_token, buffer = per_token_kv_bytes(first.kv), _address(latent_keys(first.kv))
    ledger.reset()
    s.coordinator.rows_leaving(batch, [1])  # row 1 ends; row 2 decodes on
    copies = ledger.snapshot()
    assert copies["reply_append.kv"] == (PROMPT + REPLY - (PROMPT - 1)) * per_token, copies
    assert "extract.kv" not in copies, copies  # never the whole row
    assert s.cache.stats["reply_appends"] == 1 and s.cache.stats["reply_row_copies"] == 0
    (new,) = [e for e in s.cache.entries() if e.length == PROMPT + REPLY]
    assert new.prompt_end == PROMPT - 1 and not s.cache.holds(first)
    assert _address(latent_keys(new.kv)) == buffer  # written into the room left at the prefill end
    # The entry answers as a cold prefill of prompt + reply does.
    follow = random_tokens(3, seed=105)
    layout = s.coordinator.lineage.runtime.layout
    warm = prefill(s.model, layout.build(new.kv, new.head, new.length), follow)
    cold = prefill(s.model, s.model.make_cache(), np.concatenate([prompts[0], replies[0], follow]))
    assert mx.allclose(warm, cold, atol=1e-4).item()
    # The next turn of that conversation, alone, is lent the buffer: it copies no KV.
    s.generator._generation_batch = None
    admit(s, 3, np.concatenate([prompts[0], replies[0], random_tokens(12, seed=106)]))
    turn = s.book.by_uid(3)
    assert turn.record.kv_admission == "lent" and new.lent


def test_a_deferred_row_a_lookup_surfaces_is_copied_with_room_for_its_reply(server, counted):
    s = server
    prompt = random_tokens(PROMPT, seed=111)
    caches, lengths = admit(s, 1, prompt)
    s.generator._prompt_batch.max_tokens = [REPLY + 2]
    prefill_and_store(s, 1, prompt, caches, lengths)
    row = s.book.by_uid(1)
    assert row.deferral is not None and s.cache.entries() == []
    # Another request's lookup would restore from it: committed now, by a copy with room.
    follow = np.concatenate([prompt, random_tokens(10, seed=112)])
    s.coordinator.lookup(follow, extra_hash=0, safe_lookup_min=0, suffix_is_text_only=lambda n: True,
                         prefix_has_media=lambda n: False)
    (entry,) = s.cache.entries()
    assert entry.lent  # the room makes it lendable to that request, which is then removed
    s.coordinator.bind_rows([2], [meta(follow)])
    s.coordinator.request_removed(2)
    assert not entry.lent and s.cache.holds(entry)
    assert row.deferral is None and row.reply is not None and row.reply.base is not None
    assert entry.kv.capacity() == reply_capacity(settings(), PROMPT - 1, PROMPT, REPLY + 2) > PROMPT + REPLY
    assert entry.nbytes == entry.kv.held_nbytes + entry.head.nbytes + entry.checkpoint_bytes


@pytest.mark.parametrize("limit", [None, 0, 8, 10**6])
def test_the_reply_room_is_max_tokens_bounded_by_the_spare_rows_an_entry_may_carry(limit):
    knobs = CopyFreeSettings()
    for length in (39, 3000, 40_000):
        rows = reply_capacity(knobs, length, length + 1, limit)
        reply = knobs.decode_reserve if limit is None else limit
        later = knobs.decode_reserve + knobs.lend_headroom
        assert rows >= length + min(1 + reply + later, knobs.spare_allowed(length))
        assert rows - length <= knobs.spare_allowed(length)  # never more room than an adopted buffer keeps
        assert rows == copyfree_merge.capacity(rows) or rows - length == knobs.spare_allowed(length)
    off = CopyFreeSettings(lend=False)
    assert reply_capacity(off, 3000, 3001, 8) == copyfree_merge.capacity(3009)
