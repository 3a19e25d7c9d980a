"""The free-space floor is read by the disk writer, never on the thread that commits (issue 29).

``DiskStore.write`` runs on the generation thread (a commit's eviction, the idle ticker): a
``statvfs`` there is file-system I/O every decoding stream would wait for on a slow volume. The
writer reads the free space before each file (with its size) and after it; a volume it finds
below the floor pauses writes, so later commits are refused at once without reading it, and
the first write after the pause is checked against the real free space before a file is opened.
"""

from __future__ import annotations

import threading

import numpy as np

from tests.disk.test_disk_store import make_cache, serve
from tests.fake_model import random_tokens as tokens

TOTAL = 10**12


class Volume:
    """``shutil.disk_usage`` of a volume whose free space a test sets; counts who read it."""

    def __init__(self, free_fraction: float) -> None:
        self.free = int(free_fraction * TOTAL)
        self.readers: list[str] = []

    def __call__(self, root) -> tuple[int, int, int]:
        self.readers.append(threading.current_thread().name)
        return TOTAL, TOTAL - self.free, self.free


def test_commits_never_read_the_free_space_and_a_write_that_fills_the_volume_pauses_the_next(
        tmp_path, model, layout) -> None:
    cache, store = make_cache(tmp_path, layout, disk_write_delay_s=0)
    volume = store.guard.usage = Volume(0.5)
    me = threading.current_thread().name
    serve(cache, model, layout, tokens(150, 81))
    assert cache.tick() == 1 and store.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    # Read before and after the file, on the writer thread only.
    assert volume.readers == ["apc-lineage-disk"] * 2 and me not in volume.readers

    # The next file leaves the volume below the 5 % floor: the writer reads that after writing it.
    volume.free = int(0.06 * TOTAL)
    serve(cache, model, layout, np.concatenate([tokens(150, 81), tokens(40, 82)]))
    real_after = store.guard.after_write

    def filled() -> None:
        volume.free = int(0.04 * TOTAL)
        real_after()

    store.guard.after_write = filled
    assert cache.tick() == 1 and store.flush()
    assert store.guard.retry_in() > 0 and "below the floor" in store.guard.last_error
    assert cache.stats["disk_write_failures"] == 0  # that file was written: nothing failed

    # Commits in the pause are refused at once, without reading the volume; the entry stays dirty.
    reads = len(volume.readers)
    serve(cache, model, layout, tokens(150, 83))
    cache.tick()
    assert cache.stats["disk_write_failures"] == 1 and store.pending == 0
    assert store.guard.stats["deferred"] == 1 and len(volume.readers) == reads
    assert any(e.dirty for e in cache.entries())

    # After the pause the write is queued; the writer reads the real free space and, still
    # below the floor, opens no file: failing closed, the entry stays dirty.
    store.guard._retry_at = 0.0
    files = sorted(tmp_path.glob("*.safetensors"))
    assert cache.flush() == 1 and store.flush()
    assert sorted(tmp_path.glob("*.safetensors")) == files
    assert store.guard.stats["floor"] == 1 and cache.stats["disk_write_failures"] == 2
    assert any(e.dirty for e in cache.entries()) and me not in volume.readers
