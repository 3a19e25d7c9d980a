"""How long one decoding stream stalls while another session's cache work runs (issue 29).

mlx-vlm serves every row from one generation thread: whatever it does for one request, every
other decoding stream waits for. Per mode (``stock``, ``patched``) and scenario, a *victim*
stream decodes ``tokens`` tokens alone, then again while an *event* runs in another session:

* ``cold-prefill``: a cold prompt of ``context`` tokens (its prefill chunks);
* ``ram-restore``: that conversation's next turn, restored from RAM (the merge copy);
* ``ram-lent``: its third turn, the second served alone first: restored from RAM lent its
  entry's buffer (``kv=lent``: no staged copy, its join's buffers made at its first chunk);
* ``disk-restore``: the same, restored from the disk tier (flushed, RAM reset first, the
  files dropped from the page cache just before the turn: ``bench.pagecache``);
* ``shared-row-end``: that conversation's next turn joins the victim's batch and ends while the
  victim decodes: its reply commit (the server's counts of reply appends and whole-row copies,
  and the victim's gap at the row's end);
* ``short-visits`` (patched servers): the other way round, the measured stream is that
  conversation's next turn, decoding ``Plan.long_tokens`` (past a 256-step regrow), while
  ``Plan.visits`` short requests join its batch and leave it one after another
  (``bench.stall_visits``);
* ``full-budget``: ``commits`` new conversations committed under a RAM budget of about two
  entries with a slow disk writer (``APC_TEST_FAULT_DISK_STALL_S``): the commits that used
  to wait for the writer;
* ``full-budget-normal`` (``patched`` only): the same with a normal writer;
* ``canary-load``: a request arrives while the idle canary loads that conversation's file
  (``bench.stall_canary``): that request's TTFT against its TTFT alone.

Modes: ``stock``, ``patched`` and ``patched-unpaced`` (decode-aware prefill off): the last two
side by side give its prefill-throughput cost (the event's computed tokens per second);
``patched-unpaced`` runs only the scenarios whose event prefills (``PACED_SCENARIOS``).
``patched-stock-join`` and ``patched-stock-grow`` are patched with mlx-vlm's own join and leave,
or its own regrow of a decoding batch's buffer.

For each: the victim's inter-token gaps (p50, p99, max) alone and with the event, and the
event's own duration at the client; patched, the server's split of the victim's worst gap
(``bench.stall_gaps``: its own step, the event's prefill, restore, join, leave, ..., and what no
unit timed). ``ram-restore`` and ``disk-restore`` are issue 40's scenario: a long conversation's
next turn while a short stream decodes. Nothing here asserts a time.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

from apcctl.lab.bench import pagecache, stall_canary, stall_gaps, stall_visits
from apcctl.lab.bench.against import base_mode, groups
from apcctl.lab.bench.stall_session import (Gaps, Loaded, Plan, Session, ask_to_disk, disk_root,
                                        event_conversation, lineage_stats)
from apcctl.lab.bench.ttft import BenchServer, next_turn

SCENARIOS = ("cold-prefill", "ram-restore", "ram-lent", "disk-restore", "shared-row-end", "short-visits",
             "full-budget", "full-budget-normal", "canary-load")
# Mode -> (the bench server's mode, extra settings): ``patched-unpaced`` is patched with
# decode-aware prefill off (``APC_DECODE_STALL_MS=0``), for its throughput cost side by side;
# ``patched-stock-join`` with mlx-vlm's own join and leave (``APC_COPYFREE_JOIN=0``, issue 40);
# ``patched-stock-grow`` with mlx-vlm's own regrow of a decoding batch's buffer every 256 steps
# (``APC_COPYFREE_GROW=0``; a server without that setting ignores it).
MODES: dict[str, tuple[str, dict[str, str]]] = {
    "stock": ("stock", {}), "patched": ("patched", {}), "patched-unpaced": ("patched", {"APC_DECODE_STALL_MS": "0"}),
    "patched-stock-join": ("patched", {"APC_COPYFREE_JOIN": "0"}),
    "patched-stock-grow": ("patched", {"APC_COPYFREE_GROW": "0"}),
}
# What ``patched-unpaced`` runs: the scenarios whose event prefills (its only difference from
# ``patched`` is the prefill's pacing); a shared row's end and the canary's load have none to pace.
PACED_SCENARIOS = ("cold-prefill", "ram-restore", "ram-lent", "disk-restore", "full-budget")
DISK_SCENARIOS = ("disk-restore", "canary-load")
BUDGET_SCENARIOS = ("full-budget", "full-budget-normal")  # a server each: their writers differ
# ``patched`` only: stock's ``full-budget`` has no slow writer already.
PATCHED_ONLY = ("full-budget-normal",)
# Every mode with a patched server (but ``patched-unpaced``: no event prefill worth pacing):
# ``short-visits`` is read through the server's split of the long stream's gaps, which stock has
# not, and its long stream is the bench's longest (stock's would double the quick run's time).
SPLIT_ONLY = ("short-visits",)
SLOW_WRITE_S = 1.0  # the full-budget server's writer sleeps this long per file
REPLY_COUNTS = ("reply_appends", "reply_row_copies")  # how a shared row's reply commit copied


def _cold_prefill(session: Session) -> dict[str, Any]:
    messages = event_conversation(session, "cold")
    return {"event": lambda: session.ask(messages)[1]}


def _restore(session: Session, tag: str, *, from_disk: bool) -> dict[str, Any]:
    """The conversation's next turn, restored from RAM, or from a file dropped from the page
    cache just before the event (after the victim's alone stream, which reads its own file)."""
    first = event_conversation(session, tag)
    text = ask_to_disk(session, first) if from_disk else session.ask(first)[0]
    prepared: dict[str, Any] = {"event": lambda: session.ask(next_turn(first, text, 0))[1]}
    if from_disk:
        dropped: list[pagecache.Dropped] = []
        prepared["before"] = lambda: dropped.append(pagecache.drop(disk_root(session.server)))
        prepared["report"] = lambda loaded: {"page_cache": dropped[-1].as_dict() | {"label": dropped[-1].label}}
    return prepared


def _lent(session: Session) -> dict[str, Any]:
    """The conversation's third turn: the second, served alone, left its entry's buffer with room
    for the next, so the third is lent it (issue 40's rounds 2-3)."""
    first = event_conversation(session, "lent")
    second = next_turn(first, session.ask(first)[0], 0)
    third = next_turn(second, session.ask(second)[0], 1)
    return {"event": lambda: session.ask(third)[1]}


def _shared_row_end(session: Session) -> dict[str, Any]:
    """Another session's next turn joins the victim's batch, replies ``shared_reply`` tokens and
    ends while the victim decodes (3x as long here): its reply commit (patched: the reply's rows
    appended into its entry's buffer, or the whole row copied when there is no room;
    ``/admin/status`` counts both)."""
    server = session.server
    first = event_conversation(session, "shared")
    text, _ = session.ask(first)
    messages = next_turn(first, text, 0)
    counts = lineage_stats(server, REPLY_COUNTS)
    times: list[float] = []

    def event() -> dict[str, Any]:
        _, _, usage = server.stream(messages, session.plan.shared_reply, on_token=times.append,
                                    extra={"ignore_eos": True})
        return usage

    def report(loaded: Loaded) -> dict[str, Any]:
        after = lineage_stats(server, REPLY_COUNTS)
        ended = times[-1] if times else 0.0
        victim = loaded.with_event
        return {"shared_reply_tokens": int((loaded.value or {}).get("completion_tokens", 0)),
                "victim_tokens": session.plan.shared_victim_tokens,
                "reply_commit": {k: after[k] - counts[k] for k in after},
                "ended_while_victim_decoded": bool(times) and victim[0] < times[0] and ended < victim[-1],
                "row_end_gap_ms": _gap_after(victim, ended)}

    return {"event": event, "report": report, "victim_tokens": session.plan.shared_victim_tokens}


def _gap_after(times: list[float], at: float, gaps: int = 2) -> float | None:
    """The largest of the first ``gaps`` inter-token gaps of ``times`` that end after ``at``
    (the step a row ended in, and the next: where its commit ran)."""
    ends = [i for i in range(1, len(times)) if times[i] > at][:gaps]
    return round(max((times[i] - times[i - 1]) * 1000 for i in ends), 1) if ends else None


def _full_budget(session: Session) -> dict[str, Any]:
    convs = [event_conversation(session, f"budget-{i}") for i in range(session.plan.commits)]

    def commits() -> dict[str, Any]:
        for messages in convs:
            session.ask(messages)
        return lineage_stats(session.server)

    return {"event": commits}


PREPARE: dict[str, Callable[[Session], dict[str, Any]]] = {
    "cold-prefill": _cold_prefill,
    "ram-restore": lambda s: _restore(s, "ram", from_disk=False),
    "ram-lent": _lent,
    "disk-restore": lambda s: _restore(s, "disk", from_disk=True),
    "shared-row-end": _shared_row_end,
    "short-visits": stall_visits.prepare,
    "full-budget": _full_budget,
    "full-budget-normal": _full_budget,
}


def gap_row(session: Session, name: str) -> dict[str, Any]:
    """A scenario of ``PREPARE``: the victim's gaps alone and with the event, the event's ms."""
    prepared = PREPARE[name](session)
    loaded = session.during(prepared["event"], prepared.get("before"), prepared.get("victim_tokens"),
                            prepared.get("stream"))
    alone, with_event, value = Gaps.of(loaded.alone), Gaps.of(loaded.with_event), loaded.value
    row: dict[str, Any] = {"alone": alone.__dict__, "with_event": with_event.__dict__, "event_ms": loaded.event_ms,
                           "max_vs_alone": round(with_event.max / alone.max, 1) if alone.max else None}
    if isinstance(value, dict) and "prompt_tokens_details" in value:
        row["event_cached_tokens"] = int((value.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
        computed = int(value.get("prompt_tokens", 0)) - row["event_cached_tokens"]
        row["event_prefill_tps"] = round(computed / loaded.event_ms * 1000, 1) if loaded.event_ms else None
    elif isinstance(value, dict):
        row["event_stats"] = value
    if "report" in prepared:
        row.update(prepared["report"](loaded))
    if (server_gaps := stall_gaps.victim_gaps(session.server, max(1, len(loaded.with_event) - 3))) is not None:
        row["server_gaps"] = server_gaps  # where the worst gap went, by the server's own split
        if prepared.get("split_alone"):  # and the stream's alone, its record just before
            row["server_gaps_alone"] = stall_gaps.victim_gaps(session.server, max(1, len(loaded.alone) - 3), older=1)
    return row


def scenario_row(session: Session, name: str) -> dict[str, Any]:
    if name == "canary-load":
        return stall_canary.run(session)
    return gap_row(session, name)


def server_env(mode: str, scenarios: list[str], budget_bytes: int) -> dict[str, str]:
    """The extra settings one server of ``mode`` needs for ``scenarios``."""
    env: dict[str, str] = dict(MODES[base_mode(mode)][1])
    if any(s in DISK_SCENARIOS + BUDGET_SCENARIOS for s in scenarios):
        env.update({"APC_DISK_ENABLED": "1"} if mode == "stock" else {"APC_LINEAGE_DISK": "1"})
    if any(s in BUDGET_SCENARIOS for s in scenarios) and mode != "stock":
        env.update({"APC_LINEAGE_RAM_BUDGET_BYTES": str(budget_bytes), "APC_LINEAGE_DISK_WRITE_DELAY_S": "0.5"})
    if "full-budget" in scenarios and mode != "stock":  # the slow writer
        env.update({"APC_TEST_FAULTS": "1", "APC_TEST_FAULT_DISK_STALL_S": str(SLOW_WRITE_S)})
    if "canary-load" in scenarios and mode != "stock":
        env.update(stall_canary.settings())
    return env


def _entry_bytes(server: BenchServer) -> int:
    """Bytes of the biggest conversation entry a patched server holds (sizes the budget)."""
    entries = server.get_json("/admin/entries?tier=ram")
    items = entries.get("entries", entries) if isinstance(entries, dict) else entries
    sizes = [max(int(e.get("bytes") or 0), int(e.get("kv_buffer_bytes") or 0)) for e in items if isinstance(e, dict)]
    return max(sizes or [0])


def run_scenarios(model_dir: Path, modes: list[str], scenarios: list[str], plan: Plan, workdir: Path,
                  timeout: float, budget_bytes: int, echo: Callable[[str], None],
                  trees: dict[str, Path] | None = None) -> tuple[list[dict[str, Any]], int]:
    """A server per mode of ``modes`` through ``scenarios``, side by side, scenario by scenario
    (the order reversed every other one: ``--against``); the rows and the biggest entry held."""
    rows: list[dict[str, Any]] = []
    entry_bytes = 0
    tag = "-".join(scenarios)
    with ExitStack() as stack:
        sessions = {mode: Session(stack.enter_context(BenchServer(
            model_dir, MODES[base_mode(mode)][0], workdir / f"{mode}-{tag}", timeout,
            env=server_env(mode, scenarios, budget_bytes), tree=(trees or {}).get(mode))), plan, model_dir)
            for mode in modes}
        for session in sessions.values():
            session.victim_times()  # warm: the victim's own prompt is cached from here on
        for i, name in enumerate(scenarios):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                session = sessions[mode]
                row = {"scenario": name, "mode": mode, **scenario_row(session, name)}
                if session.server.patched and not entry_bytes:
                    entry_bytes = _entry_bytes(session.server)
                rows.append(row)
                echo(f"  {mode} {name}: {_summary(row)}")
    return rows, entry_bytes


def of_mode(mode: str, scenarios: list[str]) -> list[str]:
    """The scenarios ``mode`` runs: all, but only ``PACED_SCENARIOS`` for ``patched-unpaced``,
    ``PATCHED_ONLY`` ones only for ``patched`` and ``SPLIT_ONLY`` ones for patched servers."""
    return [s for s in scenarios if (mode != "patched-unpaced" or s in PACED_SCENARIOS)
            and (base_mode(mode) == "patched" or s not in PATCHED_ONLY)
            and (MODES[base_mode(mode)][0] == "patched" or s not in SPLIT_ONLY)]


def _needs_nothing_more(mode: str, plain: list[str], name: str) -> bool:
    """Whether budget scenario ``name`` needs no setting ``mode``'s server for ``plain`` lacks,
    whatever the budget: then it runs there, one server start fewer."""
    return all(server_env(mode, plain + [name], b) == server_env(mode, plain, b) for b in (0, 1))


def run(model_dir: Path, modes: list[str], scenarios: list[str], plan: Plan, workdir: Path, timeout: float,
        echo: Callable[[str], None], trees: dict[str, Path] | None = None) -> dict[str, Any]:
    """Every mode through the scenarios: one server per mode for the plain and disk scenarios,
    another per budget scenario (its RAM budget is about two of the first server's entries)
    unless it needs no setting the first lacks (stock's: no budget, no writer to slow)."""
    plain = [s for s in scenarios if s not in BUDGET_SCENARIOS]
    budgeted = [s for s in scenarios if s in BUDGET_SCENARIOS]
    result: dict[str, Any] = {"plan": plan.__dict__, "modes": modes, "scenarios": scenarios, "rows": [],
                              "load_avg": list(os.getloadavg()), "workdir": str(workdir)}
    entry_bytes = 0
    ran: set[tuple[str, str]] = set()  # (budget scenario, group's first mode) run on the plain server
    for group in groups(modes):  # a ``patched@REF`` of ``trees`` beside ``patched`` (``bench.against``)
        own = of_mode(group[0], plain)
        joined = [s for s in of_mode(group[0], budgeted) if own and _needs_nothing_more(group[0], own, s)]
        if own:
            rows, held = run_scenarios(model_dir, group, own + joined, plan, workdir, timeout, 0, echo, trees)
            result["rows"] += rows
            entry_bytes = max(entry_bytes, held)
            ran.update((name, group[0]) for name in joined)
    budget = int(2.5 * entry_bytes) if entry_bytes else 4 * 2**20
    result["budget_bytes"] = budget
    for name in budgeted:
        for group in (g for g in groups(modes) if of_mode(g[0], [name]) and (name, g[0]) not in ran):
            rows, _ = run_scenarios(model_dir, group, [name], plan, workdir, timeout, budget, echo, trees)
            result["rows"] += rows
    result["load_avg_end"] = list(os.getloadavg())
    return result


def _summary(row: dict[str, Any]) -> str:
    if row["scenario"] == "canary-load":
        return (f"TTFT {_ms(row['ttft_with_median'])} ms with the canary loading vs "
                f"{_ms(row['ttft_alone_median'])} alone")
    return (f"victim max gap {row['with_event']['max']:.0f} ms vs {row['alone']['max']:.0f} alone; "
            f"event {row['event_ms']:.0f} ms")


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def notes(row: dict[str, Any]) -> str:
    """What the event did besides its time: the page cache, the reply commit, the evictions."""
    parts = []
    if "page_cache" in row:
        parts.append(f"page cache {row['page_cache']['label']}")
    if "row_end_gap_ms" in row:
        commit = row.get("reply_commit") or {}
        parts.append(f"row-end gap {_ms(row['row_end_gap_ms'])} ms"
                     + ("" if row.get("ended_while_victim_decoded") else " (ended after the victim)"))
        if commit:
            parts.append(f"reply appended {commit.get('reply_appends', 0)}, "
                         f"row copied {commit.get('reply_row_copies', 0)}")
    if "visits" in row:
        parts.append(stall_visits.notes(row))
    if (worst := (row.get("server_gaps_alone") or {}).get("worst_gap")):
        parts.append(f"server's worst gap alone {stall_gaps.parts_text(worst)}")
    if (worst := (row.get("server_gaps") or {}).get("worst_gap")):
        parts.append(f"server's worst gap {stall_gaps.parts_text(worst)}")
    if "visits" in row and (waited := (row.get("server_gaps") or {}).get("waited")):
        parts.append(f"waited in all {stall_gaps.largest(waited, limit=len(waited))}")
    stats = row.get("event_stats") or {}
    if stats:
        parts.append(f"evictions {stats.get('evictions', 0)} (unwritten {stats.get('evicted_unwritten', 0)})")
    return "; ".join(parts)


def render(result: dict[str, Any]) -> str:
    """A row per gap scenario and mode, then the canary's TTFT rows."""
    head = (f"{'scenario':<18} {'mode':<16} {'alone p50/p99/max ms':>22} {'with event p50/p99/max ms':>27} "
            f"{'max ×':>6} {'event ms':>9} {'prefill tok/s':>14}  notes")
    gap_rows = [r for r in result["rows"] if r["scenario"] != "canary-load"]
    lines = [head, "-" * len(head)] if gap_rows else []
    for row in gap_rows:
        a, w = row["alone"], row["with_event"]
        tps = row.get("event_prefill_tps") if row.get("event_cached_tokens") == 0 else None  # a cold prefill's
        lines.append(f"{row['scenario']:<18} {row['mode']:<16} {a['p50']:>7.0f}/{a['p99']:>6.0f}/{a['max']:>6.0f}  "
                     f"{w['p50']:>10.0f}/{w['p99']:>6.0f}/{w['max']:>7.0f}  "
                     f"{row['max_vs_alone'] or 0:>6.1f} {row['event_ms']:>9.0f} {tps if tps else '':>14}  {notes(row)}")
    canary = [r for r in result["rows"] if r["scenario"] == "canary-load"]
    if canary:
        lines += [""] if lines else []
        lines.append(f"{'canary-load':<18} {'mode':<16} {'TTFT alone ms':>14} {'with the canary loading':>24} "
                     f"{'×':>5}  notes")
        for row in canary:
            lines.append(f"{'canary-load':<18} {row['mode']:<16} {_ms(row['ttft_alone_median']):>14} "
                         f"{_ms(row['ttft_with_median']):>24} {row.get('ttft_vs_alone') or '':>5}  "
                         f"{_canary_notes(row)}")
    lines.append(_footer(result))
    return "\n".join(lines)


def _footer(result: dict[str, Any]) -> str:
    plan, ran = result["plan"], {r["scenario"] for r in result["rows"]}
    parts = [f"victim: {plan['tokens']} tokens", f"event conversation ~{plan['context']:,} tokens"]
    if "shared-row-end" in ran:
        parts.append(f"shared-row-end reply {Plan(**plan).shared_reply} tokens")
    if "short-visits" in ran:
        parts.append(f"short-visits: the long stream {Plan(**plan).long_tokens} tokens, {plan['visits']} visits of "
                     f"~{plan['victim_context']} tokens replying {plan['visit_reply']}")
    if ran & set(BUDGET_SCENARIOS):
        parts.append(f"full-budget: {plan['commits']} commits under {result.get('budget_bytes', 0):,} bytes, "
                     f"writer {SLOW_WRITE_S:g} s per file (patched)")
    parts.append(f"load average {result['load_avg'][0]:.1f} at the start, "
                 f"{result.get('load_avg_end', [0])[0]:.1f} at the end")
    return "; ".join(parts)


def _canary_notes(row: dict[str, Any]) -> str:
    if row.get("canary") is None:
        return row.get("note", "")
    canary = row["canary"]
    rounds = len(row["ttft_with_ms"])
    return (f"medians of {rounds}; loading at arrival {row['loading_at_arrival']}/{rounds}, at its first token "
            f"{row['loading_at_first_token']}/{rounds}; the load ~{_ms(row['load_ms_median'])} ms; "
            f"{row['record']['disk_bytes'] or 0:,} B file, disk points loaded {canary['disk_points_loaded']}; "
            f"page cache {row['page_cache']['label']}")
