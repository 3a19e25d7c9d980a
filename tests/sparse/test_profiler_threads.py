"""The layer profiler's forward in progress is its thread's (issue 35: no module-level runtime
state): two generation threads in one process (two models served) each time their own forward,
never lapping into, or closing, the other's record."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from server_patch.sparse import profiler


def test_two_threads_forwards_open_at_once_each_end_with_their_own_record(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profiler.ENV_FLAG, str(tmp_path / "profile.flag"))
    monkeypatch.setenv(profiler.ENV_LOG, str(tmp_path / "profile.jsonl"))
    profiler.enable()
    both_open, records = threading.Barrier(2), {}
    dense = SimpleNamespace(mlp=object())  # a decoder layer whose MLP is dense

    def forward(length: int, layers: int) -> None:
        profiler.begin_forward(mx.zeros((1, length, 4)))
        both_open.wait(30)  # the other thread's forward began meanwhile
        for _ in range(layers):
            profiler.after_layer(dense, mx.zeros(1))
        both_open.wait(30)
        records[length] = profiler.end_forward(mx.zeros(1))

    threads = [threading.Thread(target=forward, args=(length, layers)) for length, layers in ((3, 1), (5, 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert records[3] is not None and records[5] is not None  # neither closed the other's
    assert records[3]["chunk"] == 3 and records[3]["layers"][profiler.DENSE_MLP] == 1
    assert records[5]["chunk"] == 5 and records[5]["layers"][profiler.DENSE_MLP] == 2
    profiler.PROFILE_LOG.drain()
