"""What the client changed in a request's prompt (its record's ``drift``, issue 37), for people:
the DRIFT cell of ``apcctl requests`` and the dashboard, the lines of ``apcctl requests ID``, and
``apcctl report``'s top causes of client drift.

Light (no numpy): the short names are strings, kept equal to ``server_patch.drift.Cause`` by
tests/cli/test_drift_view.py. Every piece of prompt text goes through ``sanitize.printable``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from apcctl.core.sanitize import printable

SHORT: dict[str, str] = {
    "reply re-rendered: stop token": "reply/stop",
    "reply re-rendered: thinking dropped": "reply/think",
    "reply re-rendered: whitespace": "reply/space",
    "reply re-rendered": "reply",
    "reply dropped on retry": "retry",
    "date/time changed": "date",
    "tools re-ordered": "tools",
    "block moved": "moved",
    "system prompt edited": "system",
    "history rebuilt on resume": "resume",
    "block removed": "removed",
    "message edited": "edit",
}


def drift_label(record: Mapping[str, Any]) -> str:
    """A request's DRIFT cell: the cause's short name and where ("date @1,204"); blank when the
    client changed nothing, ``-`` from a server before issue 37."""
    drift = record.get("drift")
    if drift is None:
        return "-"
    if not drift:
        return ""
    cause = str(drift.get("cause", "?"))
    return f"{SHORT.get(cause, printable(cause))} @{int(drift.get('position', 0)):,}"


def drift_lines(drift: Mapping[str, Any] | None) -> list[str]:
    """The drift block of one request: cause, segment, position, cost, and the short text diff."""
    if not drift:
        return ["drift: none (the prompt extends the nearest earlier one of its namespace, or none was seen)"]
    lines = [f"drift: {printable(drift.get('cause', '?'))} in {printable(drift.get('segment', '?'))} "
             f"at token {int(drift.get('position', 0)):,} (the earlier prompt had "
             f"{int(drift.get('earlier_tokens', 0)):,} tokens, {int(drift.get('tokens', 0)):,} past it)"]
    if not any(key in drift for key in ("context", "removed", "added")):
        lines.append("  (text diff off: APC_DRIFT_TEXT=0)")
        return lines
    lines.append(f"  …{printable(drift.get('context', ''))}")
    lines.append(f"  - {printable(drift.get('removed', ''))}")
    lines.append(f"  + {printable(drift.get('added', ''))}")
    return lines


def detail_lines(record: Mapping[str, Any]) -> list[str]:
    """``apcctl requests ID``: every field of the record, one per line, then its drift block."""
    lines = [f"{key}: {printable(value)}" for key, value in record.items() if key != "drift"]
    return lines + drift_lines(record.get("drift"))


def drift_summary(requests: Iterable[Mapping[str, Any]], top: int = 5) -> dict[str, Any]:
    """What clients changed over a report's requests (``apcctl report``): how many requests
    parted from an earlier prompt, and the top causes by the tokens they put out of reach."""
    counts: dict[str, list[int]] = {}
    for record in requests:
        drift = record.get("drift") or {}
        if drift.get("cause"):
            row = counts.setdefault(str(drift["cause"]), [0, 0])
            row[0] += 1
            row[1] += int(drift.get("tokens", 0))
    causes = sorted(counts.items(), key=lambda item: (-item[1][1], -item[1][0], item[0]))
    return {"requests": sum(n for n, _ in counts.values()), "tokens": sum(t for _, t in counts.values()),
            "top_causes": [{"cause": c, "requests": n, "tokens": t} for c, (n, t) in causes[:top]]}


def describe_drift(summary: Mapping[str, Any]) -> str:
    """One line: "12 requests (48,210 tokens): date/time changed 8 (40,000 tokens), ...";
    "none" when no client changed an earlier prompt."""
    if not summary.get("requests"):
        return "none"
    top = ", ".join(f"{printable(c['cause'])} {c['requests']:,} ({c['tokens']:,} tokens)" for c in summary["top_causes"])
    return f"{summary['requests']:,} requests ({summary['tokens']:,} tokens): {top}"


__all__ = ["SHORT", "describe_drift", "detail_lines", "drift_label", "drift_lines", "drift_summary"]
