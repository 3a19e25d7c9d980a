"""How long one decoding stream stalls while another session's cache work runs (issue 29).

mlx-vlm serves every row from one generation thread: whatever it does for one request, every
other decoding stream waits for. Per mode (``stock``, ``patched``) and scenario, a *victim*
stream decodes ``tokens`` tokens alone, then again while an *event* runs in another session:

* ``cold-prefill``: a cold prompt of ``context`` tokens (its prefill chunks);
* ``ram-restore``: that conversation's next turn, restored from RAM (the merge copy);
* ``disk-restore``: the same, restored from the disk tier (flushed, RAM reset first);
* ``full-budget``: ``commits`` new conversations committed under a RAM budget of about two
  entries with a slow disk writer (``APC_TEST_FAULT_DISK_STALL_S``): the commits that used
  to wait for the writer.

Modes: ``stock``, ``patched`` and ``patched-unpaced`` (decode-aware prefill off): the last two
side by side give its prefill-throughput cost (the event's computed tokens per second).

For each: the victim's inter-token gaps (p50, p99, max) alone and with the event, and the
event's own duration at the client. Nothing here asserts a time.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from apcctl.bench.ttft import BenchError, BenchServer, conversation, next_turn

SCENARIOS = ("cold-prefill", "ram-restore", "disk-restore", "full-budget")
# Mode -> (the bench server's mode, extra settings): ``patched-unpaced`` is patched with
# decode-aware prefill off (``APC_DECODE_STALL_MS=0``), for its throughput cost side by side.
MODES: dict[str, tuple[str, dict[str, str]]] = {
    "stock": ("stock", {}), "patched": ("patched", {}), "patched-unpaced": ("patched", {"APC_DECODE_STALL_MS": "0"}),
}
DISK_SCENARIOS = ("disk-restore",)
BUDGET_SCENARIOS = ("full-budget",)
SLOW_WRITE_S = 1.0  # the full-budget server's writer sleeps this long per file
LEAD_TOKENS = 3  # the event starts once the victim has streamed this many tokens


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


class Session:
    """One server of a mode and the two sessions it serves: the victim and the other one."""

    def __init__(self, server: BenchServer, plan: Plan, model_dir: Path) -> None:
        self.server, self.plan = server, plan
        self.victim = _tagged(conversation(plan.victim_context, model_dir), "victim")
        self.model_dir = model_dir

    def victim_stream(self, started: threading.Event | None = None) -> Gaps:
        times: list[float] = []

        def on_token(at: float) -> None:
            times.append(at)
            if started is not None and len(times) == LEAD_TOKENS:
                started.set()

        self.server.stream(self.victim, self.plan.tokens, on_token=on_token, extra={"ignore_eos": True})
        if started is not None:
            started.set()  # a reply shorter than the lead: the event still runs
        return Gaps.of(times)

    def ask(self, messages: list[dict[str, str]], max_tokens: int = 1) -> tuple[str, dict[str, Any]]:
        _, text, usage = self.server.stream(messages, max_tokens)
        return text, usage

    def during(self, event: Callable[[], Any]) -> tuple[Gaps, Gaps, float, Any]:
        """(victim alone, victim with ``event``, the event's ms, what the event returned)."""
        alone = self.victim_stream()
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
        loaded = self.victim_stream(started)
        thread.join()
        if "error" in result:
            raise BenchError(f"{self.server.mode}: the event failed: {result['error']}")
        return alone, loaded, result["ms"], result.get("value")


def _tagged(messages: list[dict[str, str]], tag: str) -> list[dict[str, str]]:
    """The messages with a system prompt of their own (sessions share no prefix)."""
    return [{"role": "system", "content": f"You are terse. Session {tag}."}, *messages[1:]]


def _event_conversation(session: Session, tag: str) -> list[dict[str, str]]:
    return _tagged(conversation(session.plan.context, session.model_dir), tag)


def _cold_prefill(session: Session) -> dict[str, Any]:
    messages = _event_conversation(session, "cold")
    return {"event": lambda: session.ask(messages)[1]}


def _restore(session: Session, tag: str, *, from_disk: bool) -> dict[str, Any]:
    first = _event_conversation(session, tag)
    text, _ = session.ask(first)
    if from_disk:
        if session.server.patched:
            session.server.get_json("/admin/flush", {"timeout": 600}, timeout=620)
        else:
            time.sleep(2.0)  # stock's writer queue: no flush endpoint
        session.server.get_json("/v1/cache/reset", {})
    return {"event": lambda: session.ask(next_turn(first, text, 0))[1]}


def _full_budget(session: Session) -> dict[str, Any]:
    convs = [_event_conversation(session, f"budget-{i}") for i in range(session.plan.commits)]

    def commits() -> dict[str, Any]:
        for messages in convs:
            session.ask(messages)
        return _lineage_stats(session.server)

    return {"event": commits}


def _lineage_stats(server: BenchServer) -> dict[str, Any]:
    if not server.patched:
        return {}
    lineage = server.get_json("/admin/status").get("lineage") or {}
    return {k: lineage.get("stats", {}).get(k, 0) for k in ("evicted_unwritten", "evictions", "disk_writes")}


PREPARE: dict[str, Callable[[Session], dict[str, Any]]] = {
    "cold-prefill": _cold_prefill,
    "ram-restore": lambda s: _restore(s, "ram", from_disk=False),
    "disk-restore": lambda s: _restore(s, "disk", from_disk=True),
    "full-budget": _full_budget,
}


def server_env(mode: str, scenarios: list[str], budget_bytes: int) -> dict[str, str]:
    """The extra settings one server of ``mode`` needs for ``scenarios``."""
    env: dict[str, str] = dict(MODES[mode][1])
    if any(s in DISK_SCENARIOS + BUDGET_SCENARIOS for s in scenarios):
        env.update({"APC_DISK_ENABLED": "1"} if mode == "stock" else {"APC_LINEAGE_DISK": "1"})
    if any(s in BUDGET_SCENARIOS for s in scenarios) and mode != "stock":
        env.update({"APC_LINEAGE_RAM_BUDGET_BYTES": str(budget_bytes), "APC_TEST_FAULTS": "1",
                    "APC_TEST_FAULT_DISK_STALL_S": str(SLOW_WRITE_S), "APC_LINEAGE_DISK_WRITE_DELAY_S": "0.5"})
    return env


def _entry_bytes(server: BenchServer) -> int:
    """Bytes of the biggest conversation entry a patched server holds (sizes the budget)."""
    entries = server.get_json("/admin/entries?tier=ram")
    items = entries.get("entries", entries) if isinstance(entries, dict) else entries
    sizes = [max(int(e.get("bytes") or 0), int(e.get("kv_buffer_bytes") or 0)) for e in items if isinstance(e, dict)]
    return max(sizes or [0])


def run_scenarios(model_dir: Path, mode: str, scenarios: list[str], plan: Plan, workdir: Path,
                  timeout: float, budget_bytes: int, echo: Callable[[str], None]) -> tuple[list[dict[str, Any]], int]:
    """One server of ``mode`` through ``scenarios``; the rows and the biggest entry it held."""
    rows: list[dict[str, Any]] = []
    entry_bytes = 0
    tag = "-".join(scenarios)
    with BenchServer(model_dir, MODES[mode][0], workdir / f"{mode}-{tag}", timeout,
                     env=server_env(mode, scenarios, budget_bytes)) as server:
        session = Session(server, plan, model_dir)
        session.victim_stream()  # warm: the victim's own prompt is cached from here on
        for name in scenarios:
            prepared = PREPARE[name](session)
            alone, loaded, event_ms, value = session.during(prepared["event"])
            if server.patched and not entry_bytes:
                entry_bytes = _entry_bytes(server)
            row = {"scenario": name, "mode": mode, "alone": alone.__dict__, "with_event": loaded.__dict__,
                   "event_ms": event_ms, "max_vs_alone": round(loaded.max / alone.max, 1) if alone.max else None}
            if isinstance(value, dict) and "prompt_tokens_details" in value:
                row["event_cached_tokens"] = int((value.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
                computed = int(value.get("prompt_tokens", 0)) - row["event_cached_tokens"]
                row["event_prefill_tps"] = round(computed / event_ms * 1000, 1) if event_ms else None
            elif isinstance(value, dict):
                row["event_stats"] = value
            rows.append(row)
            echo(f"  {mode} {name}: victim max gap {loaded.max:.0f} ms vs {alone.max:.0f} alone; "
                 f"event {event_ms:.0f} ms")
    return rows, entry_bytes


def run(model_dir: Path, modes: list[str], scenarios: list[str], plan: Plan, workdir: Path, timeout: float,
        echo: Callable[[str], None]) -> dict[str, Any]:
    """Every mode through the scenarios: one server per mode for the plain and disk scenarios,
    another for ``full-budget`` (its RAM budget is about two of the first server's entries)."""
    plain = [s for s in scenarios if s not in BUDGET_SCENARIOS]
    budgeted = [s for s in scenarios if s in BUDGET_SCENARIOS]
    result: dict[str, Any] = {"plan": plan.__dict__, "modes": modes, "scenarios": scenarios, "rows": [],
                              "load_avg": list(os.getloadavg()), "workdir": str(workdir)}
    entry_bytes = 0
    for mode in modes:
        if plain:
            rows, held = run_scenarios(model_dir, mode, plain, plan, workdir, timeout, 0, echo)
            result["rows"] += rows
            entry_bytes = max(entry_bytes, held)
    budget = int(2.5 * entry_bytes) if entry_bytes else 4 * 2**20
    result["budget_bytes"] = budget
    for mode in modes:
        if budgeted:
            rows, _ = run_scenarios(model_dir, mode, budgeted, plan, workdir, timeout, budget, echo)
            result["rows"] += rows
    result["load_avg_end"] = list(os.getloadavg())
    return result


def render(result: dict[str, Any]) -> str:
    """One table: a row per scenario and mode."""
    head = (f"{'scenario':<14} {'mode':<16} {'alone p50/p99/max ms':>22} {'with event p50/p99/max ms':>27} "
            f"{'max ×':>6} {'event ms':>9} {'prefill tok/s':>14}")
    lines = [head, "-" * len(head)]
    for row in result["rows"]:
        a, w = row["alone"], row["with_event"]
        tps = row.get("event_prefill_tps")
        lines.append(f"{row['scenario']:<14} {row['mode']:<16} {a['p50']:>7.0f}/{a['p99']:>6.0f}/{a['max']:>6.0f}  "
                     f"{w['p50']:>10.0f}/{w['p99']:>6.0f}/{w['max']:>7.0f}  "
                     f"{row['max_vs_alone'] or 0:>6.1f} {row['event_ms']:>9.0f} {tps if tps else '':>14}")
    plan = result["plan"]
    lines.append(f"victim: {plan['tokens']} tokens; event conversation ~{plan['context']:,} tokens; "
                 f"full-budget: {plan['commits']} commits under {result.get('budget_bytes', 0):,} bytes, "
                 f"writer {SLOW_WRITE_S:g} s per file (patched)")
    return "\n".join(lines)
