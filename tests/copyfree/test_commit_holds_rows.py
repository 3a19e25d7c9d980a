"""A decoding row's commit holds through the row machine (issue 35, decision 0013).

A lone row's deferred buffer is its hold of kind ``DEFERRED`` from its prefill end to its
adoption; a row whose reply is appended into its prompt-end entry's buffer holds that entry
(``BASE``) until it commits, so RAM pressure meanwhile evicts other entries and the reply is
still appended, not copied; everything is let go at the row's end (``release``). Driven as
test_row_machine.py drives the real coordinator: fake batches over the kilobyte model's real
caches, invariants checked after every cache verb.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from server_patch.lineage.holds import BASE, DEFERRED
from server_patch.state import rows
from tests.copyfree.test_reply_append import PROMPT, REPLY, joined_and_decoded
from tests.fake_model import prefill, random_tokens
from tests.integration.test_row_machine import admit, decode, prefill_and_store, server, to_decoding  # noqa: F401 (the fixture)
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")


def held(s, row) -> list[tuple[str, str]]:
    """What ``row`` holds of the cache: (kind, entry id or key)."""
    return [(h.kind, h.entry_id) for h in s.cache._holds.of(row)]


def pressure(s, seed: int, room: int = 1) -> None:
    """Another conversation's entry committed under a budget of ``room`` bytes (1: nothing fits,
    every entry leaves RAM); then the budget is as it was (the pressure passed)."""
    budget = s.cache.config.ram_budget_bytes
    s.cache.config = replace(s.cache.config, ram_budget_bytes=room)
    tokens = random_tokens(PROMPT, seed=seed)
    caches = s.model.make_cache()
    prefill(s.model, caches, tokens)
    kv, head = rows.extract(s.coordinator.lineage.runtime.layout, caches, None, PROMPT - 1)
    assert s.cache.commit(tokens, kv=kv, head=head) is None  # it left RAM at once: nobody holds it
    s.pressed_ram = s.cache.ram_used
    s.cache.config = replace(s.cache.config, ram_budget_bytes=budget)


def test_a_lone_rows_deferral_is_a_hold_until_its_buffer_is_adopted(server):
    prompt, reply = random_tokens(PROMPT, seed=61), random_tokens(REPLY, seed=62)
    caches, lengths = admit(server, 1, prompt)
    prefill_and_store(server, 1, prompt, caches, lengths)
    row = server.book.by_uid(1)
    assert row.deferral is not None and held(server, row) == [(DEFERRED, "deferred:1")]
    assert server.cache.ram_used == 0  # its buffer is not counted: mlx-vlm's while it decodes
    batch = to_decoding(server, 1)
    decode(server, batch, reply)
    server.coordinator.rows_leaving(batch, [])
    (entry,) = server.cache.entries()  # adopted past its reply
    assert entry.length == PROMPT + REPLY and held(server, row) == []


def test_a_deferral_left_unseen_is_committed_and_let_go_by_the_one_sweep(server):
    prompt = random_tokens(PROMPT, seed=63)
    caches, lengths = admit(server, 1, prompt)
    prefill_and_store(server, 1, prompt, caches, lengths)
    row = server.book.by_uid(1)
    assert held(server, row) == [(DEFERRED, "deferred:1")]
    server.generator._prompt_batch = None  # its row left and nobody saw it
    admit(server, 2, random_tokens(30, seed=64))  # the next lookup's sweep
    (entry,) = [e for e in server.cache.entries() if e.length == PROMPT - 1]
    assert row.deferral is None and row.reply is None and row.state == "ended" and held(server, row) == []


def test_a_reply_appends_base_is_held_so_pressure_evicts_others_first_and_the_reply_is_appended(server):
    prompt, reply = random_tokens(PROMPT, seed=65), random_tokens(REPLY, seed=66)
    entry, batch = joined_and_decoded(server, prompt, reply)
    row = server.book.by_uid(1)
    assert held(server, row) == [(BASE, entry.id)]  # taken when the join adopted its prompt end
    pressure(server, seed=67, room=entry.nbytes)  # room for one entry: the newer, unheld one leaves
    assert server.cache.get(entry.id) is entry, "the entry its reply extends was evicted"
    assert server.pressed_ram == entry.nbytes  # within the budget
    server.coordinator.rows_leaving(batch, [0])  # row 1 ends
    (new,) = server.cache.entries()
    assert new.length == PROMPT + REPLY and not server.cache.holds(entry)  # absorbed
    assert server.cache.stats["reply_appends"] == 1 and server.cache.stats["reply_row_copies"] == 0
    assert held(server, row) == []  # let go at its commit: nothing pins the new entry
    assert server.cache._evictable(new)


def test_a_base_leaves_when_nothing_else_can_and_the_row_copies(server):
    """Decision 0013, amended: the RAM budget stays a bound. Under pressure nothing else can
    relieve, the held base leaves too, and the row's end copies the whole row (exact)."""
    prompt, reply = random_tokens(PROMPT, seed=65), random_tokens(REPLY, seed=66)
    entry, batch = joined_and_decoded(server, prompt, reply)
    row = server.book.by_uid(1)
    assert held(server, row) == [(BASE, entry.id)]
    pressure(server, seed=67)
    assert server.cache.get(entry.id) is None and server.pressed_ram == 0
    server.coordinator.rows_leaving(batch, [0])
    assert server.cache.stats["reply_appends"] == 0 and server.cache.stats["reply_row_copies"] == 1
    assert held(server, row) == []


def test_release_lets_a_reply_base_go_and_eviction_then_wins_the_row_copies(server):
    """The control: without its hold (``release(owner)`` let it go), the same pressure evicts
    the base and the row's end copies the whole row (fails closed, as before the hold)."""
    prompt, reply = random_tokens(PROMPT, seed=65), random_tokens(REPLY, seed=66)
    entry, batch = joined_and_decoded(server, prompt, reply)
    row = server.book.by_uid(1)
    assert server.cache.release(row) == 1 and held(server, row) == []
    pressure(server, seed=67)
    assert server.cache.get(entry.id) is None
    server.coordinator.rows_leaving(batch, [0])
    assert server.cache.stats["reply_appends"] == 0 and server.cache.stats["reply_row_copies"] == 1
    assert np.array_equal(row.pending.tokens, prompt)
