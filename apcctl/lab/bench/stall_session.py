"""The two sessions of ``bench stall`` on one server: a victim stream, and another session's event.

A *victim* decodes ``tokens`` tokens alone, then again while an event runs in another session
(started once the victim has streamed ``LEAD_TOKENS``); the scenarios (``bench.stall``,
``bench.stall_canary``) say what the event is. Nothing here asserts a time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from apcctl.lab.bench.pagecache import sizes_under
from apcctl.lab.bench.ttft import BenchError, BenchServer, conversation

LEAD_TOKENS = 3  # the event starts once the victim has streamed this many tokens
REGROW_STEPS = 256  # mlx-vlm's ``BatchKVCache.step``: a batch buffer regrows every this many decode steps
VISIT_SLACK = 16  # ``short-visits``: the long stream's tokens a visit's prefill and request may take


@dataclass
class Gaps:
    """Inter-token gaps of one stream, ms."""

    tokens: int
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, times: list[float]) -> "Gaps":
        gaps = np.diff(np.asarray(times)) * 1000 if len(times) > 1 else np.zeros(1)
        return cls(len(times), *(round(float(v), 1) for v in (np.percentile(gaps, 50),
                                                                np.percentile(gaps, 99), gaps.max())))


@dataclass
class Plan:
    """The sizes of one run."""

    context: int  # tokens of the other session's conversation
    tokens: int  # the victim's reply length
    commits: int  # conversations committed in ``full-budget``
    victim_context: int = 200
    repeat: int = 3  # ``canary-load``: TTFT samples alone and with the canary loading
    visits: int = 3  # ``short-visits``: short requests, one after another, beside the long stream
    visit_reply: int = 16  # ``short-visits``: each visit's reply

    @property
    def shared_reply(self) -> int:
        """``shared-row-end``: the other row's reply, short enough to end while the victim decodes."""
        return max(2, min(32, self.tokens // 6))

    @property
    def shared_victim_tokens(self) -> int:
        """``shared-row-end``: the victim decodes this long, so the other row (its restore, then
        its reply in the victim's batch) ends well inside the victim's stream."""
        return 3 * self.tokens

    @property
    def long_tokens(self) -> int:
        """``short-visits``: the long stream's reply. A join leaves its joint buffer one regrow
        step of room, so the stream decodes that much past the last visit's expected end (each
        visit its reply and ``VISIT_SLACK``): it crosses a regrow after the visits too."""
        return max(self.tokens, LEAD_TOKENS + self.visits * (self.visit_reply + VISIT_SLACK) + REGROW_STEPS + 32)


@dataclass
class Loaded:
    """The victim's token times alone and with the event, and the event's own duration."""

    alone: list[float]
    with_event: list[float]
    event_ms: float
    value: Any


class Session:
    """One server of a mode and the two sessions it serves: the victim and the other one."""

    def __init__(self, server: BenchServer, plan: Plan, model_dir: Path) -> None:
        self.server, self.plan = server, plan
        self.victim = tagged(conversation(plan.victim_context, model_dir), "victim")
        self.model_dir = model_dir

    def victim_times(self, started: threading.Event | None = None, tokens: int | None = None,
                     stream: list[dict[str, str]] | None = None) -> list[float]:
        """The ``perf_counter`` time of every token of one victim reply (``tokens`` long, default
        the plan's; ``stream``: other messages than the victim's); ``started`` is set at its
        ``LEAD_TOKENS``-th."""
        times: list[float] = []

        def on_token(at: float) -> None:
            times.append(at)
            if started is not None and len(times) == LEAD_TOKENS:
                started.set()

        self.server.stream(stream or self.victim, tokens or self.plan.tokens, on_token=on_token,
                           extra={"ignore_eos": True})
        if started is not None:
            started.set()  # a reply shorter than the lead: the event still runs
        return times

    def ask(self, messages: list[dict[str, str]], max_tokens: int = 1) -> tuple[str, dict[str, Any]]:
        _, text, usage = self.server.stream(messages, max_tokens)
        return text, usage

    def during(self, event: Callable[[], Any], before: Callable[[], Any] | None = None,
               tokens: int | None = None, stream: list[dict[str, str]] | None = None) -> Loaded:
        """The victim alone, then with ``event`` (``before`` runs between the two, say a page
        cache drop the alone stream must not undo); ``tokens``: the victim's reply length,
        ``stream``: the measured messages when they are not the victim's (``short-visits``)."""
        alone = self.victim_times(tokens=tokens, stream=stream)
        if before is not None:
            before()
        started = threading.Event()
        result: dict[str, Any] = {}

        def run_event() -> None:
            started.wait()
            begin = time.perf_counter()
            try:
                result["value"] = event()
            except Exception as exc:  # reported by the caller, after the victim's stream
                result["error"] = exc
            result["ms"] = round((time.perf_counter() - begin) * 1000, 1)

        thread = threading.Thread(target=run_event, daemon=True)
        thread.start()
        loaded = self.victim_times(started, tokens, stream)
        thread.join()
        if "error" in result:
            raise BenchError(f"{self.server.mode}: the event failed: {result['error']}")
        return Loaded(alone, loaded, result["ms"], result.get("value"))


def tagged(messages: list[dict[str, str]], tag: str) -> list[dict[str, str]]:
    """The messages with a system prompt of their own (sessions share no prefix)."""
    return [{"role": "system", "content": f"You are terse. Session {tag}."}, *messages[1:]]


def event_conversation(session: Session, tag: str) -> list[dict[str, str]]:
    return tagged(conversation(session.plan.context, session.model_dir), tag)


def lineage_stats(server: BenchServer, keys: tuple[str, ...] = ("evicted_unwritten", "evictions", "disk_writes")
                  ) -> dict[str, int]:
    """Counters of the patched server's lineage cache (``/admin/status``); {} for stock."""
    if not server.patched:
        return {}
    lineage = server.get_json("/admin/status").get("lineage") or {}
    return {k: int(lineage.get("stats", {}).get(k, 0)) for k in keys}


def disk_root(server: BenchServer) -> Path:
    """Where the server's disk tier writes: the lineage tier (patched) or stock's own."""
    return Path(server.env["APC_LINEAGE_DISK_PATH" if server.patched else "APC_DISK_PATH"])


def ask_to_disk(session: Session, messages: list[dict[str, str]]) -> str:
    """Ask ``messages`` (one token), write every entry to the disk tier, then empty RAM: the
    next turn restores from a file. The reply's text."""
    server = session.server
    root = disk_root(server)
    before = sizes_under(root)
    text, _ = session.ask(messages)
    if server.patched:
        server.get_json("/admin/flush", {"timeout": 600}, timeout=620)
    else:
        _settled(root, before)  # stock's writer queue: no flush endpoint
    server.get_json("/v1/cache/reset", {})
    return text


def _settled(root: Path, before: dict[Path, int], quiet_s: float = 1.0, wait_s: float = 600.0) -> None:
    """Until the files under ``root`` differ from ``before`` and stop changing for ``quiet_s``
    (stock's writer has written the new entry)."""
    deadline = time.monotonic() + wait_s
    last: dict[Path, int] | None = None
    while time.monotonic() < deadline:
        now = sizes_under(root)
        if now != before and now == last:
            return
        last = now
        time.sleep(quiet_s)
