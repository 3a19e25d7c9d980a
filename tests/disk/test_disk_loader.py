"""Disk files load off the generation thread (issue 29): ``disk.loader`` and the canary's use.

The canary's disk points used to read their file on the generation thread (0.6-1.3 s for a
545 MB file, with no yield point): a request arriving meanwhile waited. Now the load runs on
the loader thread, and the idle pass only polls it. Stand-in stores; states, not times.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from server_patch.canary import runner
from server_patch.disk.loader import THREAD_NAME, BackgroundLoads


class GatedStore:
    """A store whose load waits for the test's gate, and says on which thread it ran."""

    def __init__(self, result=("entry", "")) -> None:
        self.gate = threading.Event()
        self.finished = threading.Event()
        self.threads: list[str] = []
        self.result = result

    def load_checked(self, record):
        self.threads.append(threading.current_thread().name)
        self.gate.wait(30)
        self.finished.set()
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def _record(record_id: str = "r1") -> SimpleNamespace:
    return SimpleNamespace(id=record_id)


def _until_ready(loads: BackgroundLoads, store, record):
    for _ in range(3000):  # bounds a hang only
        ready, value = loads.poll(store, record)
        if ready:
            return value
        time.sleep(0.01)
    raise AssertionError("the load never finished")


def test_a_load_runs_on_the_loader_thread_and_poll_never_waits_for_it() -> None:
    loads, store = BackgroundLoads(), GatedStore()
    assert loads.poll(store, _record()) == (False, None)  # started
    assert loads.poll(store, _record()) == (False, None)  # the gate is shut: still loading
    assert not store.finished.is_set() and loads.pending() == 1
    store.gate.set()
    assert _until_ready(loads, store, _record()) == ("entry", "")
    assert store.threads == [store.threads[0]] and store.threads[0].startswith(THREAD_NAME)
    assert store.threads[0] != threading.current_thread().name
    assert loads.pending() == 0


def test_a_load_that_raises_fails_closed_and_a_stale_result_is_dropped() -> None:
    loads = BackgroundLoads()
    broken = GatedStore(result=OSError("disk gone"))
    broken.gate.set()
    entry, why = _until_ready(loads, broken, _record("bad"))
    assert entry is None and "disk gone" in why
    stale = GatedStore()
    stale.gate.set()
    loads.poll(stale, _record("left"))  # a check cancelled before it polled again
    stale.finished.wait(30)
    other = GatedStore()
    loads.poll(other, _record("next"))
    assert list(loads._pending) == [(id(other), "next")]  # the finished, unclaimed one let go


def test_the_canary_resumes_a_disk_point_once_its_file_has_loaded() -> None:
    loads, store = BackgroundLoads(), GatedStore()
    record = SimpleNamespace(id="r1")
    rt = SimpleNamespace(disk=store, cache=SimpleNamespace(records=lambda: [record]), checks=loads)
    with pytest.raises(runner.LoadPending):
        runner._from_disk(rt, "r1")  # the idle pass returns; the generation thread is free
    store.gate.set()
    store.finished.wait(30)
    for _ in range(3000):
        try:
            assert runner._from_disk(rt, "r1") == ("entry", "")
            break
        except runner.LoadPending:
            time.sleep(0.01)
    else:
        raise AssertionError("the load never finished")
