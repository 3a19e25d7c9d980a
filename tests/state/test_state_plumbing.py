"""The mlx plumbing: restores equal cold prefills, and stored states never change."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.fake_model import prefill, random_tokens as tokens
from server_patch.lineage import LineageCache, LineageConfig
from server_patch.state.registry import UnsupportedCacheError, codec_for
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb


def test_layout_classifies_every_glm5_next_cache_kind(layout):
    # KDA layers are snapshots; attention layers are composite with the projected cache derived.
    assert layout.describe() == "arrays;arrays;[kv,kv,pooling,derived];arrays;[kv,derived]"


def test_unknown_cache_class_is_a_clear_error():
    class Strange:
        pass

    with pytest.raises(UnsupportedCacheError, match="Strange"):
        codec_for(Strange())


@pytest.mark.parametrize("cut", [15, 16, 100, 150])
def test_restore_at_any_length_gives_cold_prefill_logits(model, layout, cut):
    prompt = tokens(260)
    live = model.make_cache()
    prefill(model, live, prompt[:cut], step=37)
    kv, snap = layout.split(live, cut)
    prefill(model, live, prompt[cut:200], step=37)  # the live cache moves on

    restored = layout.build(kv, snap, cut)
    warm = prefill(model, restored, prompt[cut:], step=64)
    cold = prefill(model, model.make_cache(), prompt, step=260)
    assert mx.allclose(warm, cold, atol=1e-5).item()


def test_checkpoint_reads_kv_rows_from_a_longer_entry(model, layout):
    """A checkpoint holds only snapshot layers; its KV comes from the entry's later rows."""
    prompt = tokens(240, seed=3)
    live = model.make_cache()
    prefill(model, live, prompt[:90], step=45)
    checkpoint = layout.snapshot(live, 90)
    prefill(model, live, prompt[90:200], step=55)
    kv, _ = layout.split(live, 200)

    restored = layout.build(kv, checkpoint, 90)
    warm = prefill(model, restored, prompt[90:], step=64)
    cold = prefill(model, model.make_cache(), prompt, step=240)
    assert mx.allclose(warm, cold, atol=1e-5).item()


def _materialize(handle) -> list[np.ndarray]:
    return [np.array(a) for a in handle.arrays()]


def test_extending_a_restored_cache_never_changes_the_stored_state(model, layout):
    prompt = tokens(300, seed=5)
    live = model.make_cache()
    prefill(model, live, prompt[:150], step=50)
    kv, snap = layout.split(live, 150)
    before_kv, before_snap = _materialize(kv), _materialize(snap)

    # Write into the live cache the state came from, and into two restores of it.
    prefill(model, live, prompt[150:300], step=7)
    for _ in range(2):
        restored = layout.build(kv, snap, 150)
        prefill(model, restored, prompt[150:290], step=9)

    for old, new in zip(before_kv + before_snap, _materialize(kv) + _materialize(snap)):
        assert np.array_equal(old, new)


def test_policy_drives_real_states_end_to_end(model, layout):
    """lookup → restore → prefill → commit over real handles: turn 2 restores turn 1's entry."""
    cache = LineageCache(LineageConfig(guard_min_suffix=64))
    turn1 = tokens(180, seed=7)
    turn2 = np.concatenate([turn1, tokens(40, seed=8)])

    live = model.make_cache()
    prefill(model, live, turn1[:-1])
    kv, head = layout.split(live, len(turn1) - 1)
    first = cache.commit(turn1, kv=kv, head=head)

    plan = cache.lookup(turn2)
    assert (plan.kind, plan.length, plan.entry) == ("entry", len(turn1) - 1, first)
    restored = layout.build(plan.entry.kv, plan.state, plan.length)
    warm = prefill(model, restored, turn2[plan.length:-1])
    cold = prefill(model, model.make_cache(), turn2[:-1], step=256)
    assert mx.allclose(warm, cold, atol=1e-5).item()
    kv2, head2 = layout.split(restored, len(turn2) - 1)
    second = cache.commit(turn2, kv=kv2, head=head2)
    assert [(c.length, c.kind) for c in second.checkpoints] == [(len(turn1) - 1, "final")]
    assert cache.entries() == [second]
    # The absorbed head still restores exactly, reading KV rows from the new entry.
    edited = np.concatenate([turn1[:-1], tokens(30, seed=9)])
    plan = cache.lookup(edited)
    assert (plan.kind, plan.length) == ("final", len(turn1) - 1)
    restored = layout.build(plan.entry.kv, plan.state, plan.length)
    warm = prefill(model, restored, edited[plan.length:])
    cold = prefill(model, model.make_cache(), edited, step=256)
    assert mx.allclose(warm, cold, atol=1e-5).item()


def test_kv_bytes_count_used_rows_not_buffer_capacity(model, layout):
    live = model.make_cache()
    prefill(model, live, tokens(40), step=40)  # KVCache allocates 256-token steps
    kv, _ = layout.split(live, 40)
    latent = live[2].caches[0]
    assert latent.keys.shape[2] == 256
    row_bytes = latent.keys.nbytes // 256
    assert kv.nbytes < 2 * 40 * row_bytes * 3  # far below three 256-row buffers
    anchor = kv.prefix(20)
    assert anchor.length == 20 and 0 < anchor.nbytes < kv.nbytes


def test_anchor_prefix_owns_its_rows(model, layout):
    """An anchor must not keep its conversation's buffer alive (or share it with a live cache)."""
    from server_patch.copyfree.counter import _address

    live = model.make_cache()
    prefill(model, live, tokens(120, seed=11), step=120)
    kv, _ = layout.split(live, 120)
    anchor = kv.prefix(60)
    source = {_address(a) for a in kv.arrays()}
    assert all(_address(a) not in source for a in anchor.arrays())
