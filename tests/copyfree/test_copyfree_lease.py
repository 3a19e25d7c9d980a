"""Lending an entry's own buffer to the lone request that extends it (``copyfree.lease``).

Real mlx arrays on the kilobyte glm5_next: an entry adopted from a one-row batch keeps its
whole buffer; the next turn is lent that buffer, appends in place, and its logits equal a
cold prefill; the entry's rows are never changed, whether the loan ends normally or someone
takes references mid-loan (then the borrower copies). Buffer identity is read from host
addresses, not inferred from timing.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.fake_model import prefill, random_tokens as tokens
from server_patch.copyfree import lease as lending
from server_patch.copyfree.counter import _address
from server_patch.copyfree.merge import merge_rows
from server_patch.disk.store import DiskStore
from server_patch.lineage import LineageCache, LineageConfig, RestorePlan
from server_patch.state import rows
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

PROMPT = tokens(260, seed=11)
N = 150  # the entry's length
SUFFIX = 60  # the next turn's new tokens


def adopted_entry(model, layout, n: int = N, spare: int = 300):
    """What a lone request leaves behind: its batch buffer adopted whole, and its head state."""
    live = model.make_cache()
    prefill(model, live, PROMPT[:n], step=64)
    batch = merge_rows([live], [n], [0], reserve=spare)
    return rows.kv_rows(layout, batch, 0, n, copy=False), rows.capture(layout, batch, 0, n)


def state_rows(kv) -> list[np.ndarray]:
    return [np.array(v) for layer in kv.trimmed_layers() for child in layer
            for v in child.values() if isinstance(v, mx.array)]


def latent(caches):
    return caches[2].caches[0]  # the first sparse-attention layer's latent KV


def cold_logits(model, n: int) -> mx.array:
    return prefill(model, model.make_cache(), PROMPT[:n], step=512)


def test_adopted_entry_keeps_its_buffer_and_is_lendable_only_with_room(model, layout):
    kv, head = adopted_entry(model, layout)
    assert kv.length == N and kv.capacity() >= N + 300
    # The spare rows cost memory: the RAM budget counts the whole buffers, not the used rows.
    assert kv.held_nbytes == sum(a.nbytes for a in kv.arrays()) > kv.nbytes
    entry = LineageCache(LineageConfig()).commit(PROMPT[:N + 1], kv=kv, head=head)
    assert entry.nbytes == kv.held_nbytes + head.nbytes
    assert lending.lendable(kv, N, N + SUFFIX + 256)
    assert not lending.lendable(kv, N, kv.capacity() + 1)  # no room: the merge copies instead
    assert not lending.lendable(kv, N - 1, N + SUFFIX)  # only at the entry's own head


def test_a_lent_buffer_is_extended_in_place_with_cold_logits(model, layout):
    kv, head = adopted_entry(model, layout)
    before = state_rows(kv)
    nbytes = kv.nbytes
    buffer = _address(kv.layers[2][0]["keys"])

    held = kv.held_nbytes
    warm = lending.lend(layout, kv, head, N)
    assert kv.lent and kv.nbytes == nbytes and kv.held_nbytes == held
    assert not any("keys" in child for layer in kv.layers for child in layer)  # no reference kept
    with pytest.raises(RuntimeError):
        kv.trimmed_layers()  # the disk writer cannot read lent rows
    assert not lending.lendable(kv, N, N)

    batch = merge_rows([warm], [N], [SUFFIX], reserve=0, lend=True)
    assert latent(warm).keys is None  # the batch cache is the buffer's only holder
    assert _address(latent(batch).keys) == buffer
    got = prefill(model, batch, PROMPT[N:N + SUFFIX], step=64)
    mx.eval([c.state for c in batch])
    assert _address(latent(batch).keys) == buffer, "the suffix was not written in place"
    assert mx.allclose(got, cold_logits(model, N + SUFFIX), atol=1e-4).item()

    # The loan ends: the entry takes its rows back from the batch cache, unchanged.
    kv.give_back(layout.lent_rows(batch, N))
    assert not kv.lent
    assert all(np.array_equal(a, b) for a, b in zip(state_rows(kv), before))
    again = prefill(model, layout.build(kv, head, N), PROMPT[N:N + SUFFIX], step=64)
    assert mx.allclose(again, got, atol=1e-5).item()


def test_a_reference_taken_mid_loan_makes_the_borrower_copy(model, layout):
    kv, head = adopted_entry(model, layout)
    before = state_rows(kv)
    batch = merge_rows([lending.lend(layout, kv, head, N)], [N], [SUFFIX], reserve=0, lend=True)
    buffer = _address(latent(batch).keys)
    # Another request needs the rows now (a parallel restore): the entry takes them back
    # while the borrower is still prefilling.
    kv.give_back(layout.lent_rows(batch, N))
    got = prefill(model, batch, PROMPT[N:N + SUFFIX], step=64)
    mx.eval([c.state for c in batch])
    assert _address(latent(batch).keys) != buffer  # copy-on-write: the borrower moved away
    assert all(np.array_equal(a, b) for a, b in zip(state_rows(kv), before))
    assert mx.allclose(got, cold_logits(model, N + SUFFIX), atol=1e-4).item()


def test_a_lent_entry_cannot_be_built_from(model, layout):
    """A restore from lent rows would pair an empty attention cache with the recurrent state at
    L: ``build`` refuses (the coordinator then prefills cold) until the rows are given back."""
    kv, head = adopted_entry(model, layout)
    warm = lending.lend(layout, kv, head, N)
    with pytest.raises(RuntimeError, match="lent"):
        layout.build(kv, head, N)
    cp = rows.capture(layout, warm, 0, N)  # any snapshot, at any length the rows would hold
    with pytest.raises(RuntimeError, match="lent"):
        layout.build(kv, cp, N)
    kv.give_back(layout.lent_rows(warm, N))
    built = layout.build(kv, head, N)
    got = prefill(model, built, PROMPT[N:N + SUFFIX], step=64)
    assert mx.allclose(got, cold_logits(model, N + SUFFIX), atol=1e-4).item()


def test_give_back_checks_what_comes_back(model, layout):
    kv, head = adopted_entry(model, layout)
    warm = lending.lend(layout, kv, head, N)
    with pytest.raises(ValueError):
        kv.give_back([[{} for _ in layer] for layer in kv.layers])  # rows missing
    short = layout.lent_rows(warm, N)
    with pytest.raises(ValueError):
        layout.lent_rows(warm, 10**6)  # a holder that no longer has the rows
    two_rows = merge_rows([warm, layout.build(*adopted_entry(model, layout, n=40), 40)], [N, 40],
                          [0, 0], reserve=0)
    with pytest.raises(ValueError):
        layout.lent_rows(two_rows, N)  # rows moved into a shared batch: fail closed
    kv.give_back(short)
    assert not kv.lent
    with pytest.raises(RuntimeError):
        kv.give_back(short)


def test_without_room_the_lent_rows_are_copied_and_still_given_back(model, layout):
    kv, head = adopted_entry(model, layout)
    before = state_rows(kv)
    warm = lending.lend(layout, kv, head, N)
    buffer = _address(latent(warm).keys)
    batch = merge_rows([warm], [N], [kv.length + 10_000], reserve=0, lend=True)
    assert _address(latent(batch).keys) != buffer  # no room: the one merge copy
    kv.give_back(layout.lent_rows(batch, N))
    assert all(np.array_equal(a, b) for a, b in zip(state_rows(kv), before))


def test_disk_file_holds_the_entry_rows_not_the_spare_room(tmp_path, model, layout):
    kv, head = adopted_entry(model, layout)
    store = DiskStore(tmp_path, fingerprint="fp", layout=layout)
    cache = LineageCache(LineageConfig(), disk=store)
    entry = cache.commit(PROMPT[:N + 1], kv=kv, head=head)
    cache.flush()
    store.flush()
    loaded = store.load(cache.records()[0])
    assert loaded is not None and loaded.kv.capacity() == N
    assert all(np.array_equal(a, b) for a, b in zip(state_rows(loaded.kv), state_rows(entry.kv)))

    # While lent (under the cache's receipt), the entry is neither written nor evicted.
    lease = lending.lend_entry(layout, cache, RestorePlan(N, "entry", entry=entry))
    assert lease is not None
    entry.dirty = True
    assert entry.lent and cache.flush() == 0 and cache.tick(now=1e12) == 0
    cache._enforce_budgets()  # noqa: SLF001 - the budget pass itself
    assert cache.holds(entry)
    cache.check()
    assert lending.end(layout, cache, lease, reason="test")
    assert not entry.lent and cache.flush() == 1
