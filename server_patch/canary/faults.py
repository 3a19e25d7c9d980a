"""Test-only faults for the canary, inert unless ``APC_TEST_FAULTS=1`` (as ``disk/faults.py``).

* ``APC_TEST_FAULT_CORRUPT_STATE=KIND[,KIND]`` (or ``all``): on the generation thread, while
  idle, every stored checkpoint of those kinds gets its recurrent state (the snapshot arrays of
  every ``arrays`` layer) shifted by 1.0, once: what a wrong restore looks like to a request.
* ``APC_TEST_FAULT_CANARY_PAUSE_FILE=PATH``: while PATH exists, the canary waits the seconds
  written in it (default 1; less if the file goes) before each chunk, looking at the request queue all along, so a
  test can send a request in the middle of a check.

Nothing else in the package reads these variables. Which states were corrupted is noted by the
state objects themselves (a weak reference each, by ``id``): each belongs to one runtime's cache,
so two runtimes share nothing, and a freed state's ``id`` reused by a later runtime's state does
not pass for corrupted.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from server_patch import settings

_corrupted: dict[int, weakref.ref[Any]] = {}  # id(state) -> the state corrupted


def _active() -> bool:
    return bool(settings.value("APC_TEST_FAULTS"))


def _was_corrupted(state: Any) -> bool:
    for stale in [key for key, ref in _corrupted.items() if ref() is None]:
        del _corrupted[stale]  # its state was freed
    ref = _corrupted.get(id(state))
    return ref is not None and ref() is state


def corrupt_states(runtime: Any) -> int:
    """Apply ``APC_TEST_FAULT_CORRUPT_STATE`` to checkpoints not corrupted yet; returns how many."""
    kinds = set(settings.value("APC_TEST_FAULT_CORRUPT_STATE"))
    if not _active() or not kinds:
        return 0
    recurrent = [[codec.name == "arrays" for codec in layer.codecs] for layer in runtime.layout.layers]
    done = 0
    for entry in runtime.cache.entries():
        for cp in entry.checkpoints:
            if _was_corrupted(cp.state) or ("all" not in kinds and cp.kind not in kinds):
                continue
            for layer, flags in zip(cp.state.layers, recurrent):
                for child, is_recurrent in zip(layer, flags):
                    if is_recurrent:
                        for key, value in list(child.items()):
                            if isinstance(value, mx.array):
                                child[key] = value + 1.0
            mx.eval(cp.state.arrays())
            _corrupted[id(cp.state)] = weakref.ref(cp.state)
            done += 1
    return done


def pause(busy: Callable[[], bool]) -> bool:
    """Wait while the pause file asks to; True as soon as ``busy()`` (the caller abandons)."""
    if not _active():
        return False
    path = settings.value("APC_TEST_FAULT_CANARY_PAUSE_FILE")
    if not path or not Path(path).exists():
        return False
    try:
        seconds = float(Path(path).read_text().strip() or 1)
    except (OSError, ValueError):
        seconds = 1.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and Path(path).exists():
        if busy():
            return True
        time.sleep(0.01)
    return busy()
