"""Run ``LineageCache.check()`` after every verb, in the tests that drive the policy.

A test module opts in with ``pytestmark = pytest.mark.usefixtures("checked_lineage")`` (and
imports the fixture). Every cache the module makes, the simulator's included, then checks its
invariants after each public verb returns or raises (the outermost call only: ``commit_reply``
calls ``commit``). Module-scoped, so hypothesis tests may use it too.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Iterator

import pytest

from server_patch.lineage import LineageCache

VERBS = ("lookup", "note_restore", "note_cold", "note_cancelled_queued", "plan_captures", "commit",
         "commit_reply", "lend", "end", "rewind", "tick", "flush", "promote", "pin", "unpin", "evict", "drop",
         "clear", "close", "hold", "reserve", "reserve_spare", "base", "defer", "release")

_depth = threading.local()
checks = {"count": 0}  # how many checks ran: a test proves the wrapper is in force


def _checked(verb: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(verb)
    def run(cache: LineageCache, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_depth, "n", 0) == 0
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return verb(cache, *args, **kwargs)
        finally:
            _depth.n -= 1
            if outer:
                checks["count"] += 1
                cache.check()
    return run


@pytest.fixture(scope="module")
def checked_lineage() -> Iterator[None]:
    """Every ``LineageCache`` verb checks the invariants after it (for the whole module)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in VERBS:
            patch.setattr(LineageCache, name, _checked(getattr(LineageCache, name)))
        yield
