"""The disk tier: atomic files, headers-only index, validation that fails closed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.fake_model import prefill, random_tokens as tokens
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


# ---------------------------------------------------------------------- integrity (issue 12)

import json  # noqa: E402
import os  # noqa: E402
import stat  # noqa: E402
import struct  # noqa: E402
import uuid  # noqa: E402

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from server_patch import private_files as durable  # noqa: E402
from server_patch.disk import integrity  # noqa: E402
from server_patch.disk.lock import DiskInUse, DiskLock, holder  # noqa: E402
def test_reply_reuse_marks_survive_a_restart(tmp_path, model, layout):
    """The protected prompt end and the reply-end checkpoints are in the file, so a restarted
    server thins as the first one would, and the prompt end still restores exactly."""
    cache, store = make_cache(tmp_path, layout)
    prompt, reply = tokens(120, 31), tokens(20, 32)
    live = model.make_cache()
    prefill(model, live, prompt[:-1])
    prompt_head = layout.snapshot(live, len(prompt) - 1)
    prefill(model, live, np.concatenate([prompt[-1:], reply]))  # the decode feeds the last prompt id, then the reply
    kv, head = layout.split(live, len(prompt) + len(reply))
    entry = cache.commit_reply(prompt, reply, kv=kv, head=head, prompt_head=prompt_head)
    assert entry.prompt_end == len(prompt) - 1
    cache.flush()
    store.flush()

    restarted, store2 = make_cache(tmp_path, layout)
    follow_up = np.concatenate([prompt, reply, tokens(30, 33)])
    plan, second, _ = serve(restarted, model, layout, follow_up)  # promoted from disk, then extended
    assert (plan.tier, plan.length) == ("disk", len(prompt) + len(reply))
    promoted = next(c for c in second.checkpoints if c.length == len(prompt) - 1)
    assert promoted.kind == "final" and not promoted.reply_end
    assert [c.length for c in second.checkpoints if c.reply_end] == [len(prompt) + len(reply)]
    restarted.flush()
    store2.flush()

    again, store3 = make_cache(tmp_path, layout)
    (record,) = again.records()
    loaded = store3.load(record)
    assert [c.length for c in loaded.checkpoints if c.reply_end] == [len(prompt) + len(reply)]
    edited = np.concatenate([prompt, tokens(10, 34)])  # the reply edited: restores at the prompt end
    plan, _, warm = serve(again, model, layout, edited)
    assert (plan.kind, plan.length) == ("final", len(prompt) - 1)
    cold = prefill(model, model.make_cache(), edited[:-1], step=512)
    assert mx.allclose(warm, cold, atol=1e-5).item()


def test_the_prompt_end_mark_is_read_back_and_checked(tmp_path, model, layout):
    cache, store = make_cache(tmp_path, layout)
    prompt, reply = tokens(100, 41), tokens(12, 42)
    live = model.make_cache()
    prefill(model, live, prompt[:-1])
    prompt_head = layout.snapshot(live, len(prompt) - 1)
    prefill(model, live, np.concatenate([prompt[-1:], reply]))
    kv, head = layout.split(live, len(prompt) + len(reply))
    entry = cache.commit_reply(prompt, reply, kv=kv, head=head, prompt_head=prompt_head)
    cache.flush()
    store.flush()
    path = tmp_path / f"{entry.id}.safetensors"
    (record,) = make_cache(tmp_path, layout)[0].records()
    assert DiskStore(tmp_path, fingerprint="fp-1", layout=layout).load(record).prompt_end == len(prompt) - 1
    rewrite_header(path, lambda h: h["__metadata__"].update(prompt_end=str(len(prompt) - 2)))
    restarted, store2 = make_cache(tmp_path, layout)
    assert restarted.records() == [] and store2.rejects == {"header": 1}  # not a checkpoint: fails closed


from server_patch.disk.space import DiskUnavailable, WriteGuard, parse_min_free  # noqa: E402
from server_patch.disk.store import _CODE, _DTYPE, _as_bytes  # noqa: E402


def written(tmp_path, model, layout, seed=11, n=150, fingerprint="fp-1", **cfg):
    """A store with one entry (with checkpoints) written; returns (store, entry, path, prompt)."""
    cache, store = make_cache(tmp_path, layout, fingerprint=fingerprint, guard_min_suffix=64, guard_tokens=16,
                              **cfg)
    first = tokens(n, seed)
    serve(cache, model, layout, first)
    prompt = np.concatenate([first, tokens(60, seed + 1)])
    _, entry, _ = serve(cache, model, layout, prompt)
    cache.flush()
    store.flush()
    return store, entry, tmp_path / f"{entry.id}.safetensors", prompt


def rewrite_header(path, edit):
    """Apply ``edit`` to the parsed header JSON, re-seal its hash, keep the data as is."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    edit(header)
    header["__metadata__"]["hash"] = integrity.header_digest(header)
    body = integrity.canonical(header)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + size:])


def test_one_flipped_tensor_byte_is_caught_at_load_and_counted(tmp_path, model, layout):
    store, entry, path, prompt = written(tmp_path, model, layout)
    header = integrity.read_header(path)
    victim = max(header.tensors, key=lambda t: t.nbytes)
    data = bytearray(path.read_bytes())
    data[header.data_start + victim.begin + victim.nbytes // 2] ^= 0x01
    path.write_bytes(bytes(data))  # same size, header untouched

    restarted, store2 = make_cache(tmp_path, layout)
    (record,) = restarted.records()  # the header is intact: indexed
    plan = restarted.lookup(np.concatenate([prompt, tokens(5, 99)]))
    assert plan.tier == "disk"
    assert store2.load(plan.record) is None
    assert store2.rejects == {"hash": 1} and not path.exists()
    restarted.promote(plan.record, None)
    assert restarted.lookup(np.concatenate([prompt, tokens(5, 99)])).kind == "cold"


def test_an_edited_checkpoint_length_is_caught_at_index_rebuild(tmp_path, model, layout):
    store, entry, path, _ = written(tmp_path, model, layout)
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + size])["__metadata__"]
    old = meta["checkpoints"]
    cps = json.loads(old)
    cps[0][0] -= 1
    new = json.dumps(cps)
    assert len(new) == len(old)  # same size: only the hash can tell
    path.write_bytes(data.replace(json.dumps(old).encode()[1:-1], json.dumps(new).encode()[1:-1], 1))
    assert path.stat().st_size == len(data) and path.read_bytes() != data

    restarted, store2 = make_cache(tmp_path, layout)
    assert restarted.records() == [] and not path.exists()
    assert store2.rejects == {"hash": 1}


@pytest.mark.parametrize("edit,reason", [
    (lambda h: h["__metadata__"].update(format="apc-lineage-v1"), "format"),
    (lambda h: h["__metadata__"].update(identity=json.dumps({"mlx": "0.1", "mlx_vlm": "0.7.10", "patch": "0.1.0"})),
     "fingerprint"),
    (lambda h: h["__metadata__"].update(layout="kv;kv"), "fingerprint"),
    (lambda h: h.update({next(k for k in h if k != "__metadata__"): [1, 2]}), "header"),
    (lambda h: h["__metadata__"].update(checkpoints=json.dumps({"a": 1})), "header"),
    (lambda h: h["__metadata__"].update(checkpoints="not json"), "header"),
    (lambda h: h["__metadata__"].pop("kv_meta"), "header"),
    (lambda h: h["__metadata__"].update(kv_meta=json.dumps([["x"]])), "header"),
    (lambda h: h["__metadata__"].update(length="7"), "header"),
    (lambda h: h["__metadata__"].update(tokens="%%%"), "header"),
])
def test_odd_headers_are_removed_and_counted_by_reason(tmp_path, model, layout, edit, reason):
    _, _, path, _ = written(tmp_path, model, layout, seed=21)
    rewrite_header(path, edit)
    restarted, store2 = make_cache(tmp_path, layout)
    assert restarted.records() == [] and not path.exists()
    assert store2.rejects == {reason: 1}


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                     max_leaves=12)


@pytest.fixture(scope="module")
def sample_file(tmp_path_factory, model, layout):
    """One valid file's bytes, written once for the fuzz tests."""
    _, _, path, _ = written(tmp_path_factory.mktemp("sample"), model, layout, seed=31)
    return path.read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["tensor", *integrity._META_KEYS]), value=_JSON, as_string=st.booleans())
def test_index_rebuild_never_raises_for_any_resealed_header(tmp_path, layout, sample_file, key, value, as_string):
    root = tmp_path / uuid.uuid4().hex
    root.mkdir()
    path = root / "e.safetensors"
    path.write_bytes(sample_file)

    def edit(header):
        if key == "tensor":
            header[next(k for k in header if k != "__metadata__")] = value
        else:
            header["__metadata__"][key] = json.dumps(value) if as_string else value

    rewrite_header(path, edit)
    store = DiskStore(root, fingerprint="fp-1", layout=layout)
    records = list(store.records())  # must not raise
    if records:  # an edit that still describes a valid file (a label) loads or fails closed
        loaded = store.load(records[0])
        assert path.exists() == (loaded is not None)
        assert sum(store.rejects.values()) == (loaded is None)
    else:
        assert not path.exists() and sum(store.rejects.values()) == 1


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 4096), junk=st.binary(max_size=64))
def test_index_rebuild_never_raises_for_cut_or_garbage_files(tmp_path, layout, sample_file, cut, junk):
    root = tmp_path / uuid.uuid4().hex
    root.mkdir()
    (root / "a.safetensors").write_bytes(sample_file[:cut] + junk)
    (root / "b.safetensors").write_bytes(junk)
    store = DiskStore(root, fingerprint="fp-1", layout=layout)
    assert list(store.records()) == []
    assert sum(store.rejects.values()) == 2 and not any(root.iterdir())


def test_other_software_versions_never_restore(tmp_path, model, layout, monkeypatch):
    _, _, path, _ = written(tmp_path, model, layout, seed=41)
    import server_patch

    monkeypatch.setattr(server_patch, "PATCH_VERSION", "9.9.9")
    restarted, store2 = make_cache(tmp_path, layout)  # same fingerprint string, newer patch
    assert restarted.records() == [] and not path.exists()
    assert store2.rejects == {"fingerprint": 1}


def test_the_fingerprint_moves_with_versions_and_kv_dtype(model, monkeypatch):
    import server_patch
    from server_patch.state import fingerprint

    base = fingerprint.model_fingerprint(model)
    assert fingerprint.kv_dtype(model) == "float32"
    monkeypatch.setattr(server_patch, "PATCH_VERSION", "9.9.9")
    assert fingerprint.model_fingerprint(model) != base
    monkeypatch.undo()
    monkeypatch.setattr(fingerprint, "_version", lambda package: "0.0.1" if package == "mlx" else "x")
    assert fingerprint.model_fingerprint(model) != base
    monkeypatch.undo()
    monkeypatch.setattr(fingerprint, "kv_dtype", lambda m: "float16")
    assert fingerprint.model_fingerprint(model) != base
    monkeypatch.undo()
    assert fingerprint.model_fingerprint(model) == base


def test_files_are_private_whatever_the_umask(tmp_path, model, layout):
    old = os.umask(0)
    try:
        root = tmp_path / "lineage" / "fp"
        _, _, path, _ = written(root, model, layout, seed=51)
        lock = DiskLock(tmp_path / "lineage").acquire()
        lock.release()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "lineage").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "lineage" / ".lock").stat().st_mode) == 0o600


def test_an_existing_open_directory_is_made_private(tmp_path, layout):
    root = tmp_path / "open"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    DiskStore(root, fingerprint="fp-1", layout=layout)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


@pytest.mark.parametrize("dtype", sorted(_CODE, key=str))
def test_every_dtype_round_trips_through_the_byte_view(dtype):
    source = mx.arange(24).reshape(2, 3, 4)
    array = (source % 2).astype(dtype) if dtype == mx.bool_ else source.astype(dtype)
    strided = array[:, 1:, :]  # a view, as trimmed KV rows are
    raw = np.frombuffer(bytes(_as_bytes(strided)), dtype=np.uint8).copy()
    back = mx.array(raw).view(_DTYPE[_CODE[dtype]]).reshape(strided.shape)
    assert back.dtype == dtype and mx.array_equal(back, strided).item()


def test_fsync_uses_full_fsync_on_macos_and_falls_back(monkeypatch, tmp_path):
    import fcntl
    import sys

    calls = []
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(fcntl, "F_FULLFSYNC", 51, raising=False)
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", fd)))

    def full(fd, op):
        calls.append(("full", op))
        if fail:
            raise OSError(45, "not supported")

    monkeypatch.setattr(fcntl, "fcntl", full)
    with open(tmp_path / "f", "wb") as f:
        fail = False
        durable.fsync_fd(f.fileno())
        assert calls == [("full", 51)]
        fail = True
        calls.clear()
        durable.fsync_fd(f.fileno())
        assert calls == [("full", 51), ("fsync", f.fileno())]
    calls.clear()
    durable.fsync_dir(tmp_path)  # the same helper for the directory
    assert calls[0] == ("full", 51)


def test_backoff_doubles_to_five_minutes_and_resets_on_success(tmp_path):
    now = [0.0]
    guard = WriteGuard(tmp_path, 0.0, clock=lambda: now[0])
    guard.admit()
    delays = [guard.failed(OSError(28, "No space left on device")) for _ in range(11)]
    assert delays[:4] == [1, 2, 4, 8] and delays[-1] == 300 and max(delays) == 300
    with pytest.raises(DiskUnavailable, match="No space left"):
        guard.admit()
    now[0] += 300
    guard.admit()
    guard.succeeded()
    assert guard.failed("again") == 1


def test_below_the_free_space_floor_no_write_is_attempted(tmp_path, model, layout):
    cache, store = make_cache(tmp_path, layout)
    store.guard.usage = lambda root: (10**12, 96 * 10**10, 4 * 10**10)  # 4 % free, floor 5 %
    serve(cache, model, layout, tokens(150, 61))
    assert cache.flush() == 1
    store.flush()
    assert cache.stats["disk_write_failures"] == 1 and not list(tmp_path.glob("*.safetensors"))
    assert store.guard.stats["floor"] == 1 and store.guard.stats["attempts"] == 0
    assert [e.dirty for e in cache.entries()] == [True]  # kept: written once there is room
    store.guard.usage = lambda root: (10**12, 5 * 10**11, 5 * 10**11)
    store.guard._retry_at = 0.0  # skip the backoff the failure started
    assert cache.flush() == 1
    store.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 1 and store.guard.delay_s == 0


def test_a_failing_write_backs_off_instead_of_retrying_every_tick(tmp_path, model, layout, monkeypatch):
    monkeypatch.setenv("APC_TEST_FAULTS", "1")
    monkeypatch.setenv("APC_TEST_FAULT_DISK_ENOSPC", "1")
    cache, store = make_cache(tmp_path, layout, disk_write_delay_s=0)
    serve(cache, model, layout, tokens(150, 71))
    for _ in range(5):
        cache.tick()
        store.flush()
    assert store.guard.stats["attempts"] == 1 and store.guard.stats["deferred"] == 4
    assert cache.stats["disk_write_failures"] == 5 and [e.dirty for e in cache.entries()] == [True]
    assert list(tmp_path.iterdir()) == []  # the temp file of the failed write is gone


@pytest.mark.parametrize("raw,value", [(None, 0.05), ("5%", 0.05), ("0.1", 0.1), ("0", 0.0), (" 12.5% ", 0.125)])
def test_min_free_parses_fractions_and_percents(raw, value):
    assert parse_min_free(raw) == pytest.approx(value)


@pytest.mark.parametrize("raw", ["5", "100%", "-1%", "lots", "1.0"])
def test_min_free_rejects_ambiguous_values(raw):
    with pytest.raises(ValueError, match="APC_LINEAGE_DISK_MIN_FREE"):
        parse_min_free(raw)


def test_one_lock_holder_per_directory(tmp_path):
    first = DiskLock(tmp_path).acquire()
    assert holder(tmp_path) == os.getpid()
    with pytest.raises(DiskInUse, match=f"in use by process {os.getpid()}"):
        DiskLock(tmp_path).acquire()
    first.release()
    assert holder(tmp_path) is None
    with DiskLock(tmp_path) as again:
        assert again.held


def test_the_launcher_locks_the_disk_root_and_sweeps_temp_files(tmp_path):
    from server_patch.launch import lock_disk_root

    env = {"APC_LINEAGE_DISK_PATH": str(tmp_path / "lineage")}
    stray = tmp_path / "lineage" / "fp" / ".e1.4242.1.tmp.safetensors"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"partial")
    lock = lock_disk_root(env)
    try:
        assert lock is not None and not stray.exists()
        with pytest.raises(SystemExit, match=f"lineage disk directory {tmp_path / 'lineage'} is in use by process "
                                             f"{os.getpid()}"):
            lock_disk_root(env)
    finally:
        lock.release()
    assert lock_disk_root({**env, "APC_LINEAGE_DISK": "0"}) is None
    with pytest.raises(SystemExit, match="APC_LINEAGE_DISK_MIN_FREE"):
        lock_disk_root({**env, "APC_LINEAGE_DISK_MIN_FREE": "5"})


def test_the_index_rebuild_leaves_this_process_temp_files_alone(tmp_path, layout):
    from server_patch.disk.integrity import temp_name

    mine = tmp_path / temp_name("e1", 7)
    mine.write_bytes(b"in flight")
    DiskStore(tmp_path, fingerprint="fp-1", layout=layout).records()
    assert mine.exists()
