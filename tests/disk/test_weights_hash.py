"""The weight files are hashed in full and the digests cached by stat (server_patch.state.weights_hash).

A change the old head/tail sample missed (rows scaled in the middle of a tensor, same size, same
inode) moves the digest; a start with unchanged files reads none of them; the cache file is 0600.
The real-server proof is tests/fault/test_fault_weights.py.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

from server_patch.state import weights_hash
from server_patch.state.weights_hash import WeightsUnreadable, changed_since_start, weights_digest

SAMPLE = 2048  # what the old fingerprint sampled at each end of a tensor


def scale_middle_rows(path: Path, factor: float = 1.5) -> list[str]:
    """Scale, in place, the rows of every large F32 matrix that lie outside its first and last
    ``SAMPLE`` values; the file keeps its size and inode. Returns the tensors changed."""
    changed = []
    with open(path, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        base = 8 + size
        for name, info in header.items():
            if name == "__metadata__" or info["dtype"] != "F32" or len(info["shape"]) != 2:
                continue
            rows, cols = info["shape"]
            skip = -(-SAMPLE // cols)  # whole rows covering the sampled values
            if rows - 2 * skip < 1:
                continue
            offset = base + info["data_offsets"][0] + skip * cols * 4
            f.seek(offset)
            middle = np.frombuffer(f.read((rows - 2 * skip) * cols * 4), dtype="<f4")
            f.seek(offset)
            f.write((middle * np.float32(factor)).astype("<f4").tobytes())
            changed.append(name)
    return changed


def head_tail_samples(path: Path) -> dict[str, bytes]:
    """The values the old fingerprint read of each tensor."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        values = np.frombuffer(data[start:end], dtype="<f4")
        out[name] = (values[:SAMPLE].tobytes() + values[-SAMPLE:].tobytes()) if values.size > 2 * SAMPLE \
            else values.tobytes()
    return out


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def test_scaling_middle_rows_moves_the_digest_but_not_the_old_sample(model_copy: Path, tmp_path: Path) -> None:
    weights = model_copy / "model.safetensors"
    cache = tmp_path / "state" / "weights-hashes.json"
    before, samples, inode, size = weights_digest(model_copy, cache), head_tail_samples(weights), \
        weights.stat().st_ino, weights.stat().st_size
    assert scale_middle_rows(weights)
    assert head_tail_samples(weights) == samples  # invisible to the old fingerprint
    assert (weights.stat().st_ino, weights.stat().st_size) == (inode, size)
    assert weights_digest(model_copy, cache) != before


def test_unchanged_files_are_not_read_again_and_the_cache_is_private(model_copy: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "state" / "weights-hashes.json"
    reads: list[str] = []
    real = weights_hash.hash_file
    monkeypatch.setattr(weights_hash, "hash_file", lambda p: reads.append(Path(p).name) or real(p))
    old = os.umask(0)
    try:
        first = weights_digest(model_copy, cache)
    finally:
        os.umask(old)
    assert sorted(reads) == ["config.json", "model.safetensors"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    reads.clear()
    assert weights_digest(model_copy, cache) == first and reads == []
    os.utime(model_copy / "model.safetensors")  # touched: read again, same bytes, same digest
    assert weights_digest(model_copy, cache) == first and reads == ["model.safetensors"]


def test_a_damaged_cache_file_only_costs_a_full_read(model_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "weights-hashes.json"
    first = weights_digest(model_copy, cache)
    cache.write_text("{not json")
    assert weights_digest(model_copy, cache) == first
    assert json.loads(cache.read_text())["format"] == weights_hash.CACHE_FORMAT


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsUnreadable, match="no \\*.safetensors"):
        weights_digest(tmp_path, None)


def test_files_changed_after_the_process_started_are_named(model_copy: Path) -> None:
    newest = max(p.stat().st_ctime_ns for p in weights_hash.weight_files(model_copy))
    assert changed_since_start(model_copy, newest + 10 * weights_hash.START_SLACK_NS) == []
    scale_middle_rows(model_copy / "model.safetensors")
    started = (model_copy / "model.safetensors").stat().st_ctime_ns - 10 * weights_hash.START_SLACK_NS
    assert model_copy / "model.safetensors" in changed_since_start(model_copy, started)


def test_the_model_argument_is_found_either_way() -> None:
    assert weights_hash.model_argument(["--port", "1", "--model", "/m"]) == "/m"
    assert weights_hash.model_argument(["--model=/m2"]) == "/m2"
    assert weights_hash.model_argument(["--port", "1"]) is None
