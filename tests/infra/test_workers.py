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
    assert third.workers.names() == ["apc-disk-load", "apc-stage", "apc-lineage-tick"]  # loader, stager, ticker
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


@pytest.fixture(autouse=True)
def _no_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APC_LINEAGE_DISK", "0")  # the runtimes here have no weight files to key a disk tier
