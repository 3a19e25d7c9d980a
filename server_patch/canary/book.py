"""What the canary found: counts by result, the last difference, suspect restore kinds.

One book per server (``integration.parts``: the server serves one text model at a time). Every result is logged
(``apc_canary result=...``), goes to the runtime's event ring as a ``canary`` event (so the
admin event stream, the dashboard and the journal see it) and is counted here for
``/admin/metrics``. A failed check marks its restore kind *suspect*; with
``APC_CANARY_ON_FAIL=cold`` the coordinator then restores nothing of that kind (a cold
prefill instead) until an operator clears it (``POST /admin/verify/clear``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, deque
from typing import Any

from server_patch import clock, settings
from server_patch.canary.check import ERROR, FAIL, PASS, SKIP, Result
from server_patch.lineage import Event

log = logging.getLogger("server_patch.canary")

RESULTS = (PASS, FAIL, SKIP, ERROR, "abandoned")
ON_FAIL = ("log", "cold")


def on_fail_from_env(environ: Any = os.environ) -> str:
    """``log`` (default) or ``cold``; an unknown value is read as ``cold``, the protective one,
    with a warning (raising here would fail every admission that asks ``refuses``)."""
    try:
        value = str(settings.value("APC_CANARY_ON_FAIL", environ)).strip().lower()
    except ValueError:  # not one of the choices
        value = str(environ.get("APC_CANARY_ON_FAIL", "")).strip().lower()
    if value not in ON_FAIL:
        log.warning("APC_CANARY_ON_FAIL=%r is not one of %s: using 'cold'", value, ", ".join(ON_FAIL))
        return "cold"
    return value


class Book:
    """Thread-safe: the generation thread records, admin threads and the coordinator read."""

    def __init__(self, on_fail: str = "log", history: int = 256) -> None:
        self.on_fail = on_fail
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.last: dict[str, Any] | None = None  # the last compared result (pass or fail)
        self.suspects: dict[str, dict[str, Any]] = {}  # restore kind -> the failure that marked it
        self.history: deque[dict[str, Any]] = deque(maxlen=history)

    def refuses(self, kind: str) -> bool:
        """Whether requests must not restore ``kind`` now (read on every admission: no lock,
        a dict membership test is atomic)."""
        return self.on_fail == "cold" and kind in self.suspects

    def abandoned(self) -> None:
        with self._lock:
            self.counts["abandoned"] += 1

    def record(self, result: Result, runtime: Any) -> None:
        view = result.as_dict()
        with self._lock:
            self.counts[result.result] += 1
            self.history.append(view)
            if result.comparison is not None:
                self.last = view
            newly = result.result == FAIL and result.point.kind not in self.suspects
            if result.result == FAIL:
                self.suspects.setdefault(result.point.kind, view)
        level = logging.WARNING if result.result in (FAIL, ERROR) else logging.INFO
        diff = view.get("max_abs_diff")
        log.log(level, "apc_canary result=%s kind=%s tier=%s entry=%s length=%d checked=%d mode=%s "
                "max_abs_diff=%s tol=%s reason=%s", result.result, result.point.kind, result.point.tier,
                result.point.entry_id, result.point.length, result.checked_tokens, view["mode"],
                "-" if diff is None else f"{diff:.3g}",
                "-" if view.get("tolerance") is None else f"{view['tolerance']:.3g}", result.reason)
        if newly:
            log.warning("apc_canary suspect kind=%s: a restore of this kind differs from a cold prefill (%s)%s",
                        result.point.kind, result.reason,
                        "; requests now prefill it cold until an operator clears it"
                        if self.on_fail == "cold" else "")
        _emit(runtime, Event("canary", result.point.entry_id, result.point.length, 0, _detail(view)))

    def clear(self, kind: str | None = None) -> list[str]:
        """Forget suspects (all, or one kind); returns the kinds cleared."""
        with self._lock:
            kinds = [k for k in self.suspects if kind is None or k == kind]
            for k in kinds:
                del self.suspects[k]
        for k in kinds:
            log.warning("apc_canary suspect kind=%s cleared by an operator", k)
        return kinds

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {"counts": {r: self.counts.get(r, 0) for r in RESULTS}, "last": self.last,
                    "suspects": dict(self.suspects), "on_fail": self.on_fail, "time": clock.wall()}


def _detail(view: dict[str, Any]) -> str:
    """The event's detail: ``<result> <kind> key=value ...`` (``apcctl report`` parses it)."""
    parts = [view["result"], view["kind"], f"tier={view['tier']}", f"checked={view['checked_tokens']}",
             f"mode={view['mode']}"]
    if view.get("max_abs_diff") is not None:
        parts += [f"diff={view['max_abs_diff']:.3g}", f"tol={view['tolerance']:.3g}"]
    if view["result"] != PASS:
        parts.append(f"reason={view['reason']}")
    return " ".join(parts)


def _emit(runtime: Any, event: Event) -> None:
    sink = getattr(getattr(runtime, "cache", None), "on_event", None)
    if sink is not None:
        try:
            sink(event)
        except Exception:  # an observer must never break the canary
            pass

