"""The disk tier: atomic files, headers-only index, validation that fails closed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from fake_model import prefill, random_tokens as tokens
from server_patch.disk.store import DiskStore
from server_patch.lineage import LineageCache, LineageConfig


def make_cache(tmp_path, layout, fingerprint="fp-1", **cfg):
    store = DiskStore(tmp_path, fingerprint=fingerprint, layout=layout)
    return LineageCache(LineageConfig(**cfg), disk=store), store


def serve(cache, model, layout, prompt):
    """A real request against the real model: restore (RAM or disk), prefill, capture, commit."""
    plan = origin = cache.lookup(prompt)
    if plan.tier == "disk":
        loaded = cache.disk.load(plan.record)
        cache.promote(plan.record, loaded)
        plan = cache.lookup(prompt)
    live = layout.build(plan.entry.kv, plan.state, plan.length) if plan.hit else model.make_cache()
    captures = {}
    position = plan.length
    for cap in cache.plan_captures(prompt, plan):
        prefill(model, live, prompt[position:cap.length])
        captures[cap.length] = (cap.kind, layout.snapshot(live, cap.length))
        position = cap.length
    logits = prefill(model, live, prompt[position:-1]) if position < len(prompt) - 1 else None
    kv, head = layout.split(live, len(prompt) - 1)
    entry = cache.commit(prompt, kv=kv, head=head, captures=captures)
    return origin, entry, logits


def test_written_entry_restores_from_disk_after_a_restart_with_cold_logits(tmp_path, model, layout):
    cache, store = make_cache(tmp_path, layout, guard_min_suffix=64, guard_tokens=16)
    first = tokens(200, 1)
    serve(cache, model, layout, first)
    second = np.concatenate([first, tokens(100, 2)])
    _, entry, _ = serve(cache, model, layout, second)
    assert [c.kind for c in entry.checkpoints] == ["guard", "final", "guard"]
    cache.flush()
    store.flush()
    files = list(tmp_path.glob("*.safetensors"))
    assert [f.name for f in files] == [f"{entry.id}.safetensors"]

    restarted, _ = make_cache(tmp_path, layout)  # a new process: index from headers only
    third = np.concatenate([second, tokens(40, 3)])
    plan, _, warm = serve(restarted, model, layout, third)
    assert (plan.tier, plan.kind, plan.length) == ("disk", "entry", 299)
    cold = prefill(model, model.make_cache(), third[:-1], step=512)
    assert mx.allclose(warm, cold, atol=1e-5).item()
    # Every checkpoint in the file restores exactly, too.
    edited = np.concatenate([first[:-1], tokens(30, 4)])
    plan, _, warm = serve(restarted, model, layout, edited)
    assert (plan.kind, plan.length) == ("final", 199)
    cold = prefill(model, model.make_cache(), edited[:-1], step=512)
    assert mx.allclose(warm, cold, atol=1e-5).item()


def test_superseded_file_is_deleted_once_its_successor_is_written(tmp_path, model, layout):
    cache, store = make_cache(tmp_path, layout)
    first = tokens(120, 5)
    _, e1, _ = serve(cache, model, layout, first)
    cache.flush()
    store.flush()
    assert (tmp_path / f"{e1.id}.safetensors").exists()
    _, e2, _ = serve(cache, model, layout, np.concatenate([first, tokens(30, 6)]))
    assert (tmp_path / f"{e1.id}.safetensors").exists()
    cache.flush()
    store.flush()
    assert not (tmp_path / f"{e1.id}.safetensors").exists()
    assert (tmp_path / f"{e2.id}.safetensors").exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip_tokens", "other_model"])
def test_invalid_files_are_ignored_and_removed(tmp_path, model, layout, damage):
    cache, store = make_cache(tmp_path, layout)
    prompt = tokens(150, 7)
    _, entry, _ = serve(cache, model, layout, prompt)
    cache.flush()
    store.flush()
    path = tmp_path / f"{entry.id}.safetensors"
    data = path.read_bytes()
    fingerprint = "fp-1"
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif damage == "flip_tokens":
        # Same length, different header tokens: the index entry no longer matches the file.
        pass
    else:
        fingerprint = "fp-2"

    restarted, store2 = make_cache(tmp_path, layout, fingerprint=fingerprint)
    if damage == "flip_tokens":
        record = restarted.records()[0]
        record.tokens = record.tokens.copy()
        record.tokens[3] += 1
        assert store2.load(record) is None
    else:
        assert restarted.records() == []
    assert not path.exists()
    plan = restarted.lookup(np.concatenate([prompt, tokens(5, 8)]))
    assert plan.kind == "cold"


def test_tensor_data_damage_behind_a_valid_header_fails_closed(tmp_path, model, layout):
    cache, store = make_cache(tmp_path, layout)
    prompt = tokens(150, 9)
    _, entry, _ = serve(cache, model, layout, prompt)
    cache.flush()
    store.flush()
    path = tmp_path / f"{entry.id}.safetensors"
    path.write_bytes(path.read_bytes() + b"extra")  # size no longer matches the header
    restarted, _ = make_cache(tmp_path, layout)
    assert restarted.records() == [] and not path.exists()


def test_leftover_temp_files_are_removed_at_start(tmp_path, layout):
    stray = tmp_path / ".abc.123.tmp.safetensors"
    stray.write_bytes(b"partial")
    DiskStore(tmp_path, fingerprint="fp-1", layout=layout).records()
    assert not stray.exists()
