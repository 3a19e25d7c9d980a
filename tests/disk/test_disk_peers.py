"""The shared disk tier (issue 38): a server restores its peers' files, read-only, as safely as its own.

Real ``DiskStore`` files written by one store (a peer) in its subdirectory of a shared
directory, read by another's ``PeerIndex``; the restored logits are compared with a cold prefill.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from server_patch.disk.integrity import SUFFIX
from server_patch.disk.peers import VANISHED, PeerIndex, PeerRecord
from server_patch.disk.store import DiskStore
from server_patch.lineage import LineageCache, LineageConfig
from tests.disk.test_disk_store import serve
from tests.fake_model import prefill, random_tokens as tokens

FP_DIR = "fp-dir"


def server(shared, name, layout, **cfg):
    """One server of the fleet: its own store in ``shared/name/FP_DIR``, its peers read."""
    store = DiskStore(shared / name / FP_DIR, fingerprint="fp-1", layout=layout)
    store.peers = PeerIndex(shared, store, interval_s=3600)  # refreshed by the tests, not a thread
    return LineageCache(LineageConfig(**cfg), disk=store), store


def written_by_peer(shared, model, layout, prompt, namespace=""):
    cache, store = server(shared, "a", layout)
    live = model.make_cache()
    prefill(model, live, prompt[:-1])
    kv, head = layout.split(live, len(prompt) - 1)
    entry = cache.commit(prompt, kv=kv, head=head, captures={}, namespace=namespace)
    cache.flush()
    store.flush()
    path = store.path_of(entry.id)
    assert path.exists()
    return entry, path


def read_by_b(tmp_path, model, layout, seed, n, more):
    """A prompt of ``n`` tokens written by peer "a", read by "b"; the prompt ``more`` tokens longer."""
    prompt = tokens(n, seed)
    entry, path = written_by_peer(tmp_path, model, layout, prompt)
    cache, store = server(tmp_path, "b", layout)
    store.peers.refresh()
    return entry, path, cache, store, np.concatenate([prompt, tokens(more, seed + 1)])


def test_a_peers_file_restores_with_cold_logits_and_is_never_removed(tmp_path, model, layout):
    entry, path, cache, store, longer = read_by_b(tmp_path, model, layout, 1, 200, 40)
    plan, _, warm = serve(cache, model, layout, longer)
    assert (plan.tier, plan.length) == ("disk", 199)
    assert isinstance(plan.record, PeerRecord) and plan.record.peer == "a"
    cold = prefill(model, model.make_cache(), longer[:-1], step=512)
    assert mx.allclose(warm, cold, atol=1e-5).item()
    assert path.exists()  # read-only: the peer's file stays its own
    cache.flush()
    store.flush()
    assert sorted(p.parent.parent.name for p in tmp_path.glob(f"*/{FP_DIR}/*{SUFFIX}")) == ["a", "b"]


def test_a_promoted_peer_entry_is_ours_once_written(tmp_path, model, layout):
    prompt = tokens(150, 15)
    entry, _ = written_by_peer(tmp_path, model, layout, prompt)
    cache, store = server(tmp_path, "b", layout)
    store.peers.refresh()
    plan = cache.lookup(np.concatenate([prompt, tokens(9, 16)]))
    promoted = cache.promote(plan.record, store.load(plan.record))
    assert promoted is None or promoted.id == entry.id
    held = cache.get(entry.id)
    assert held is not None and held.dirty and not held.on_disk  # not ours on disk until written
    cache.flush()
    store.flush()
    assert store.path_of(entry.id).exists()


def test_a_namespace_restores_only_its_own_files_from_a_peer(tmp_path, model, layout):
    prompt = tokens(150, 3)
    written_by_peer(tmp_path, model, layout, prompt, namespace="tenant-1")
    cache, store = server(tmp_path, "b", layout)
    store.peers.refresh()
    longer = np.concatenate([prompt, tokens(20, 4)])
    assert cache.lookup(longer, "tenant-2").length == 0
    assert cache.lookup(longer, "").length == 0
    assert cache.lookup(longer, "tenant-1").length == 149


def test_a_file_that_vanishes_before_its_load_fails_closed(tmp_path, model, layout):
    _, path, cache, store, longer = read_by_b(tmp_path, model, layout, 5, 150, 20)
    plan = cache.lookup(longer)
    assert plan.tier == "disk"
    path.unlink()  # the peer evicted it between our listing and our load
    entry, why = store.load_checked(plan.record)
    assert (entry, why) == (None, VANISHED)
    cache.promote(plan.record, None, reason=why)
    assert cache.lookup(longer).length == 0  # forgotten: the next lookup prefills cold


def test_temp_files_and_damaged_peer_files_are_skipped_and_left_alone(tmp_path, model, layout):
    prompt = tokens(150, 7)
    _, path = written_by_peer(tmp_path, model, layout, prompt)
    half = path.parent / f".{'f' * 12}.{os.getpid() + 1}.1.tmp{SUFFIX}"  # a write in flight
    half.write_bytes(path.read_bytes()[:100])
    torn = path.parent / f"{'e' * 12}{SUFFIX}"
    torn.write_bytes(path.read_bytes()[:200])
    cache, store = server(tmp_path, "b", layout)
    store.peers.refresh()
    assert [r.id for r in store.peers.records()] == [path.name[:-len(SUFFIX)]]
    assert half.exists() and torn.exists()  # a peer's files are never removed here


def test_the_index_reads_only_new_headers(tmp_path, model, layout):
    written_by_peer(tmp_path, model, layout, tokens(120, 8))
    cache, store = server(tmp_path, "b", layout)
    index = store.peers
    index.refresh()
    reads = index.health()["header_reads"]
    index.refresh()
    assert index.health()["header_reads"] == reads  # nothing new: no header read again
    written_by_peer(tmp_path, model, layout, tokens(120, 9))
    index.refresh()
    assert index.health()["header_reads"] == reads + 1
    assert len(index.records()) == 2


@pytest.mark.parametrize("damage", ["other_owner", "group_writable", "symlink"])
def test_a_peer_directory_others_could_write_is_refused(tmp_path, model, layout, damage):
    prompt = tokens(150, 10)
    _, path = written_by_peer(tmp_path, model, layout, prompt)
    peer_dir = tmp_path / "a"
    if damage == "other_owner":
        if os.getuid() != 0:
            pytest.fail("chown needs root: this suite runs as root on CI")
        os.chown(peer_dir / FP_DIR, 12345, -1)
    elif damage == "group_writable":
        os.chmod(peer_dir, 0o770)
    else:
        os.rename(peer_dir / FP_DIR, tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", peer_dir / FP_DIR)
    cache, store = server(tmp_path, "b", layout)
    store.peers.refresh()
    assert store.peers.records() == ()
    assert "a" in store.peers.refused
    assert cache.lookup(np.concatenate([prompt, tokens(10, 11)])).length == 0


def test_own_files_win_ties_and_peers_ours_already_holds_are_skipped(tmp_path, model, layout):
    prompt = tokens(150, 12)
    written_by_peer(tmp_path, model, layout, prompt)
    cache, store = server(tmp_path, "b", layout)
    store.peers.refresh()
    longer = np.concatenate([prompt, tokens(20, 13)])
    serve(cache, model, layout, longer)  # restores the peer's file, commits its own entry
    cache.flush()
    store.flush()
    plan = cache.lookup(np.concatenate([longer, tokens(5, 14)]))
    assert plan.hit and not isinstance(plan.record, PeerRecord)


class _Tier:
    """A disk tier's index only (own records, and the peers' last scan): what ``lookup`` reads."""

    def __init__(self, own, peer):
        self.own = own
        self.peers = type("Peers", (), {"records": staticmethod(lambda: tuple(peer))})()

    def records(self):
        return self.own


def _record(record_id, prompt, checkpoints=()):
    from server_patch.lineage.model import DiskRecord

    return DiskRecord(id=record_id, tokens=prompt, namespace="", checkpoints=tuple(checkpoints), nbytes=1,
                      last_used=0.0)


def test_the_longest_point_wins_across_own_and_peer_files_and_the_floor_skips_only_shorter_ones():
    prompt = tokens(400, 20)
    own = [_record("own", np.concatenate([prompt[:200], tokens(50, 21)]), [(100, "segment")])]
    peer = [_record("short", np.concatenate([prompt[:150], tokens(50, 22)])),  # skipped by the floor
            _record("long", np.concatenate([prompt[:300], tokens(50, 23)]), [(250, "segment")]),
            _record("tie", np.concatenate([prompt[:300], tokens(50, 24)]), [(250, "segment")])]
    tier = _Tier(own, peer)
    cache = LineageCache(LineageConfig(), disk=tier)
    plan = cache.lookup(prompt)
    assert (plan.record.id, plan.length, plan.shared) == ("long", 250, 300)  # the first of equals
    tier.peers = None
    plan = cache.lookup(prompt)
    assert (plan.record.id, plan.length, plan.shared) == ("own", 100, 200)


def _age(directory, seconds):
    for path in directory.glob(f"*{SUFFIX}"):
        os.utime(path, (path.stat().st_atime - seconds, path.stat().st_mtime - seconds))


def test_a_removed_servers_files_stay_readable_until_the_retention_then_go(tmp_path, model, layout):
    from server_patch.disk.lock import DiskLock

    prompt = tokens(150, 30)
    _, path = written_by_peer(tmp_path, model, layout, prompt)  # "a" is gone: nobody holds its lock
    cache, store = server(tmp_path, "b", layout)
    store.peers.retention_s = 3600
    store.peers.refresh()
    assert len(store.peers.records()) == 1  # gone, but within the retention: still restored from
    _age(path.parent, 7200)
    running = DiskLock(tmp_path / "a").acquire()  # a server runs there again: never collected
    try:
        store.peers.refresh()
        assert path.exists() and len(store.peers.records()) == 1
    finally:
        running.release()
    store.peers.refresh()
    assert not path.exists() and store.peers.records() == ()
    assert cache.lookup(np.concatenate([prompt, tokens(5, 31)])).length == 0
