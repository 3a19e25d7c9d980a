"""A runtime's workers (``server_patch.infra.workers``): its own queues, on threads the process reuses.

Each lineage runtime builds its workers (the disk writer, the ticker, the requests' loader, the
stager) and closes them with it;
their OS threads come from the process's park, so a replaced runtime leaves no thread behind
and the next runtime's workers run on the same threads (MLX never frees a thread's stream).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from server_patch.infra.workers import PARK, PARKED, ThreadPark, Worker, Workers


def ran_on(worker: Worker) -> threading.Thread:
    """The thread ``worker`` runs its jobs on (after every job queued before)."""
    seen: list[threading.Thread] = []
    assert worker.submit(lambda: seen.append(threading.current_thread()))
    assert worker.drain(timeout=30)
    return seen[0]


def test_two_runtimes_workers_run_on_threads_of_their_own_at_once() -> None:
    park = ThreadPark()
    first, second = Workers(park), Workers(park)
    a, b = first.worker("apc-lineage-disk"), second.worker("apc-lineage-disk")
    gate = threading.Event()
    assert a.submit(gate.wait)  # the first runtime's writer is busy...
    assert ran_on(b) is not None  # ...and the second's still runs its job: no shared queue
    gate.set()
    assert ran_on(a) is not ran_on(b) and park.counts() == {"threads": 2, "parked": 0}
    assert first.close(timeout=30) and second.close(timeout=30)
    assert park.counts() == {"threads": 2, "parked": 2}


def test_a_closed_runtimes_thread_serves_the_next_runtime_and_its_setup_runs_once_per_thread() -> None:
    park = ThreadPark()
    setups: list[int] = []

    def setup() -> None:  # what an MLX stream is: made once per thread, kept by it
        setups.append(threading.get_ident())

    old = Workers(park)
    thread = ran_on(old.worker("apc-lineage-disk", setup=setup))
    assert thread.name == "apc-lineage-disk"
    assert old.close(timeout=30) and thread.name == PARKED and thread.is_alive()
    new = Workers(park)
    assert ran_on(new.worker("apc-lineage-disk", setup=setup)) is thread
    assert setups == [thread.ident] and park.counts() == {"threads": 1, "parked": 0}
    assert new.close(timeout=30)


def test_close_runs_what_was_queued_then_refuses_and_a_failed_job_ends_nothing() -> None:
    park = ThreadPark()
    worker, done = Worker("apc-test", park), []
    gate = threading.Event()
    assert worker.submit(gate.wait) and worker.submit(lambda: 1 / 0) and worker.submit(lambda: done.append(1))
    closing = threading.Thread(target=worker.close, args=(30,))
    closing.start()
    gate.set()
    closing.join(30)
    assert done == [1] and worker.closed and not worker.submit(lambda: done.append(2))
    assert park.counts()["parked"] == 1 and done == [1]


def test_a_bounded_worker_refuses_instead_of_waiting() -> None:
    worker = Worker("apc-test", ThreadPark(), capacity=1)
    gate = threading.Event()
    assert worker.submit(gate.wait)  # running (no longer queued) once the thread takes it
    assert not worker.drain(timeout=0)  # its marker waits behind the running job
    assert not worker.submit(lambda: None)  # the marker fills the one place: refused, never a wait
    gate.set()
    assert worker.close(timeout=30)


def test_a_model_switch_closes_the_old_runtimes_workers_and_the_thread_count_is_back(model: Any) -> None:
    """Two lineage runtimes in one process own separate workers; the replaced one's close gives
    their threads back, and the next runtime runs on them: no thread started, none left over."""
    from server_patch.integration.runtime import LineageRuntime

    def tickers() -> int:
        return [t.name for t in threading.enumerate()].count("apc-lineage-tick")

    def threads() -> tuple[int, int]:
        """Threads alive once each runtime's one-shot shadow warm-up read its journal, and the park's."""
        for thread in threading.enumerate():
            if thread.name == "apc-oracle-warmup":
                thread.join(60)
        return threading.active_count(), PARK.counts()["threads"]

    open_before = tickers()
    first, second = LineageRuntime(model), LineageRuntime(model)
    try:
        assert first.workers is not second.workers and tickers() == open_before + 2  # one ticker each, at once
    finally:
        first.close(timeout=30)
    assert tickers() == open_before + 1 and first.workers.names() == []
    before = threads()
    third = LineageRuntime(model)  # the switch: the replaced runtime closed, the next one built
    assert threads() == before  # on the closed one's thread
    # loader, stager, the canary's check loader (its thread borrowed at its first check), ticker
    assert third.workers.names() == ["apc-disk-load", "apc-stage", "apc-canary-load", "apc-lineage-tick"]
    assert tickers() == open_before + 2
    second.close(timeout=30)
    third.close(timeout=30)
    assert threads() == before and tickers() == open_before


def loaded_on(loads: Any) -> threading.Thread:
    """The thread a ``BackgroundLoads`` runs its jobs on (the poll waits for the job)."""
    seen: list[threading.Thread] = []

    def load(record: Any) -> tuple[Any, str]:
        seen.append(threading.current_thread())
        return record, ""

    record = SimpleNamespace(id="probe")
    assert loads.poll(object(), record, load=load, wait_s=30) == (True, (record, ""))
    return seen[0]


def test_a_model_switch_leaves_the_thread_count_flat_with_the_runtimes_loader_and_stager(model: Any) -> None:
    """The queued requests' loader and the stager (``LineageRuntime.loads``, ``.stages``) are the
    runtime's workers: each ran MLX work on a thread of the park, and after a switch the next
    runtime's loads and copies run on the replaced runtime's threads, none started."""
    from server_patch.integration.runtime import LineageRuntime

    first = LineageRuntime(model)
    loader, stager = loaded_on(first.loads), loaded_on(first.stages)
    assert loader is not stager and (loader.name, stager.name) == ("apc-disk-load", "apc-stage")
    lent = {t.ident for t in threading.enumerate()}
    first.close(timeout=30)
    assert first.workers.names() == [] and loader.name == stager.name == PARKED and loader.is_alive()
    started = PARK.counts()["threads"]
    second = LineageRuntime(model)  # the switch
    try:
        assert {loaded_on(second.loads).ident, loaded_on(second.stages).ident} <= lent
        assert PARK.counts()["threads"] == started  # no thread started for the new runtime's workers
    finally:
        second.close(timeout=30)
    finished, (entry, why) = first.loads.poll(object(), SimpleNamespace(id="late"), load=lambda r: (r, ""), wait_s=30)
    assert finished and entry is None and "closed" in why  # a closed runtime's load fails closed


def _row(width: int, written: int, seed: int) -> Any:
    """A one-row ``BatchKVCache`` of ``width`` columns, ``written`` of them written."""
    import mlx.core as mx
    from mlx_vlm.models.cache import BatchKVCache

    cache = BatchKVCache([0])
    key = mx.random.key(seed)
    cache.keys = mx.random.normal((1, 2, width, 16), key=key).astype(mx.bfloat16)
    cache.values = mx.random.normal((1, 2, width, 16), key=mx.random.split(key)[0]).astype(mx.bfloat16)
    cache._idx = written
    cache.offset = cache.offset + written
    return cache


def test_two_runtimes_keep_their_own_joint_spares_and_check_loads(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: the joint batch buffers a runtime's stager made ahead (``LineageRuntime.spares``)
    are taken only by a join of that runtime's generator (the door names them around its
    ``_extend_generation_batch``), and dropped with it; each runtime's canary loads its files on
    its own queue (``.checks``), so a check stuck on one runtime's file leaves the other's alone."""
    from server_patch.copyfree import pool, spares
    from server_patch.copyfree.settings import CopyFreeSettings
    from server_patch.integration import hooks
    from server_patch.integration.runtime import LineageRuntime

    monkeypatch.setattr(pool, "_settings", CopyFreeSettings())  # copy-free joins on, as served
    first, second = LineageRuntime(model), LineageRuntime(model)
    try:
        staged = _row(768, 300, seed=1)
        first.spares.reserve([staged.keys, staged.values])  # what first's stager makes for its turn
        assert (first.spares.count(), second.spares.count()) == (2, 0)
        with spares.joining(second.spares):  # second's generator joins a batch of the same shape
            joined = _row(256, 20, seed=2)
            assert hooks.kv_rows_join(joined, _row(768, 300, seed=3))
        assert joined.keys.shape == (2, 2, 768, 16) and first.spares.count() == 2  # not first's
        with spares.joining(first.spares):
            assert hooks.kv_rows_join(_row(256, 20, seed=4), staged)
        assert first.spares.count() == 0  # first's own join took them
        assert hooks.kv_rows_join(_row(256, 20, seed=5), _row(768, 300, seed=6)) and spares.of_this_join() is None
        first.spares.reserve([staged.keys, staged.values])

        gate, record = threading.Event(), SimpleNamespace(id="stuck")
        assert first.checks is not second.checks and first.checks is not first.loads
        assert first.checks.poll(object(), record, load=lambda r: (gate.wait(60), "")) == (False, None)
        assert loaded_on(second.checks) is not None  # second's check loads while first's waits
        assert (first.checks.pending(), second.checks.pending()) == (1, 0)
        gate.set()
    finally:
        first.close(timeout=30)
        second.close(timeout=30)
    assert first.spares.count() == 0  # a closed runtime holds no buffer made ahead


@pytest.fixture(autouse=True)
def _no_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APC_LINEAGE_DISK", "0")  # the runtimes here have no weight files to key a disk tier
