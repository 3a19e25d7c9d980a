"""``apcctl bench spec``: the same conversation on a lineage server without and with the MTP
drafter, side by side (issue 39).

Per warm turn: the restore (kind, tokens restored and prefilled), the server's TTFT
(``/admin/requests``), decode tokens per second and the drafter's rounds, drafts and accepted
drafts (mlx-vlm's ``timings``), and whether the reply equals the no-drafter server's. Not a test:
nothing asserts a time. The drafter is constructed on the target's dominant path, which only the
``tiny-spec`` and ``bench-spec`` presets have (docs/models.md): it agrees with the target's greedy tokens on ~60-70% of positions, so the
acceptance measured here is real, and so is what a round saves or costs.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

from apcctl.lab.bench.ttft import BenchError, BenchServer, conversation, newest_record, next_turn

SIDES = ("off", "mtp")


def _turn(server: BenchServer, messages: list[dict[str, str]], max_tokens: int, cursor: dict[str, int]) -> tuple[dict[str, Any], str]:
    answer = server.get_json("/v1/chat/completions", {
        "model": str(server.model_dir), "messages": messages, "temperature": 0.0, "max_tokens": max_tokens},
        timeout=3600)
    usage, timings = answer["usage"], answer.get("timings") or {}
    prompt = int(usage["prompt_tokens"])
    record = newest_record(server, cursor.get("seq", 0), prompt)
    cursor["seq"] = int(record["seq"])
    reply = answer["choices"][0]["message"]["content"] or ""
    return {
        "kind": record["restore_kind"], "prompt_tokens": prompt,
        "restored_tokens": int(record["restored_tokens"]),
        "prefilled_tokens": prompt - int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        "ttft_ms": float(record["ttft_ms"]), "completion_tokens": int(usage["completion_tokens"]),
        "decode_tps": float(timings.get("predicted_per_second") or 0.0),
        "draft_rounds": int(timings.get("draft_rounds") or 0), "drafted": int(timings.get("draft_n") or 0),
        "accepted": int(timings.get("draft_n_accepted") or 0),
    }, reply


def run_side(model_dir: Path, drafter: Path | None, context: int, questions: int, max_tokens: int,
             workdir: Path, timeout: float, echo: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[str]]:
    """The turns of one server (``drafter`` None: no speculation) and its replies."""
    env = {} if drafter is None else {"MLX_VLM_DRAFT_MODEL": str(drafter), "MLX_VLM_DRAFT_KIND": "mtp"}
    side = "off" if drafter is None else "mtp"
    turns, replies = [], []
    with BenchServer(model_dir, "patched", workdir / side, timeout, env=env) as server:
        messages = conversation(context, model_dir)
        cursor: dict[str, int] = {}
        for i in range(questions + 1):
            turn, reply = _turn(server, messages, max_tokens, cursor)
            echo(f"{side} turn {i}: {turn['kind']} restored {turn['restored_tokens']}/{turn['prompt_tokens']} "
                 f"ttft {turn['ttft_ms']:.0f} ms, decode {turn['decode_tps']:.1f} tok/s, "
                 f"accepted {turn['accepted']}/{turn['drafted']}")
            turns.append(turn)
            replies.append(reply)
            messages = next_turn(messages, reply, i)
    return turns, replies


def summarize(turns: list[dict[str, Any]]) -> dict[str, Any]:
    warm = turns[1:] or turns
    rounds = sum(t["draft_rounds"] for t in turns)
    drafted = sum(t["drafted"] for t in turns)
    return {
        "warm_ttft_ms_median": round(statistics.median(t["ttft_ms"] for t in warm), 1),
        "decode_tps_median": round(statistics.median(t["decode_tps"] for t in turns), 2),
        "accepted_per_round": round(sum(t["accepted"] for t in turns) / rounds, 3) if rounds else None,
        "acceptance": round(sum(t["accepted"] for t in turns) / drafted, 3) if drafted else None,
        "prefilled_tokens": sum(t["prefilled_tokens"] for t in turns),
    }


def run(model_dir: Path, drafter: Path, context: int, questions: int, max_tokens: int, workdir: Path,
        timeout: float, echo: Callable[[str], None]) -> dict[str, Any]:
    sides: dict[str, Any] = {}
    replies: dict[str, list[str]] = {}
    for side in SIDES:
        turns, replies[side] = run_side(model_dir, drafter if side == "mtp" else None, context, questions,
                                        max_tokens, workdir, timeout, echo)
        sides[side] = {"turns": turns, "summary": summarize(turns)}
    same = [a == b for a, b in zip(replies["off"], replies["mtp"])]
    return {"model_dir": str(model_dir), "drafter": str(drafter), "context": context,
            "max_tokens": max_tokens, "sides": sides, "replies_equal": same}


def render(result: dict[str, Any]) -> str:
    rows = [("", *SIDES)]
    for key in ("warm_ttft_ms_median", "decode_tps_median", "accepted_per_round", "acceptance", "prefilled_tokens"):
        rows.append((key, *(str(result["sides"][s]["summary"][key]) for s in SIDES)))
    width = max(len(r[0]) for r in rows)
    lines = [f"{r[0]:<{width}}  " + "  ".join(f"{c:>10}" for c in r[1:]) for r in rows]
    equal = result["replies_equal"]
    lines.append(f"replies equal with and without the drafter: {sum(equal)}/{len(equal)} turns")
    return "\n".join(lines)


__all__ = ["BenchError", "render", "run"]
