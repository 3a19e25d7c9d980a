"""The tables of ``apcctl bench ttft``: one column per mode, then the tokens of every turn."""

from __future__ import annotations

from typing import Any, Callable, Sequence


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def _table(rows: Sequence[Sequence[Any]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def summary_table(result: dict[str, Any]) -> list[str]:
    modes = result["modes"]
    s = result["summary"]
    rows: list[tuple[Any, ...]] = [("", *modes)]

    def row(label: str, fn: Callable[[dict[str, Any]], str]) -> None:
        rows.append((label, *(fn(s[m]) if s[m].get("warm_turns") else "-" for m in modes)))

    row("warm turns", lambda x: f"{x['warm_turns']}")
    row("prompt tokens (last warm turn)", lambda x: f"{x['prompt_tokens']:,}")
    row("restored / prefilled tokens (median)", lambda x: f"{x['restored_tokens']:,.0f} / {x['prefilled_tokens']:,.0f}")
    row("reply tokens (median)", lambda x: f"{x['reply_tokens']:,.0f}")
    row("TTFT, client (median)", lambda x: _ms(x.get("ttft_ms")))
    row("TTFT, client, from the 3rd warm turn", lambda x: _ms(x.get("ttft_ms_steady")))
    row("  server: lookup", lambda x: _ms(x.get("server_lookup_ms")))
    row("  server: admission (lookup + merge)", lambda x: _ms(x.get("server_admission_ms")))
    row("  server: prefill", lambda x: _ms(x.get("server_prefill_ms")))
    row("  server: commit", lambda x: _ms(x.get("server_commit_ms")))
    row("  server: TTFT", lambda x: _ms(x.get("server_ttft_ms")))
    row("KV copied per warm turn (whole turn)", lambda x: f"{x['kv_copied_bytes'] / 1e6:,.1f} MB")
    row("  of which before the first token", lambda x: "-" if x.get("kv_copied_to_first_token_bytes") is None
        else f"{x['kv_copied_to_first_token_bytes'] / 1e6:,.1f} MB")
    row("warm turns lent the entry's buffer", lambda x: f"{x['lent_turns']} of {x['warm_turns']}")
    row("split read from", lambda x: x["source"])
    targets = result.get("targets", {})
    rows.append(("TTFT / faster suffix forward", *(
        f"{targets[m]['ratio']:.2f}x" if targets.get(m, {}).get("ratio") else "-" for m in modes)))
    return _table(rows)


def turns_table(result: dict[str, Any]) -> list[str]:
    """Per turn and mode: prompt / restored / prefilled tokens, and the client TTFT."""
    modes = result["modes"]
    count = max(len(result["turns"][m]) for m in modes)
    rows: list[tuple[Any, ...]] = [("turn", *(f"{m}: prompt / restored / prefilled, TTFT" for m in modes))]
    for i in range(count):
        cells = []
        for m in modes:
            turns = result["turns"][m]
            t = turns[i] if i < len(turns) else None
            cells.append("-" if t is None else f"{t['prompt_tokens']:,} / {t['restored_tokens']:,} / "
                         f"{t['prefilled_tokens']:,}, {t['ttft_ms']:,.0f} ms")
        rows.append((str(i), *cells))
    return _table(rows)


def forward_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for f in result.get("forward", []):
        lines.append(
            f"suffix forward in-process for {', '.join(f['modes'])} ({f['suffix']} tokens over {f['context']:,}): "
            f"stock attention {f['stock_one_forward_ms']:,.0f} ms (clone + merge before it "
            f"{f['stock_restore_ms']:,.0f} ms), patched {f['one_forward_ms']:,.0f} ms (merge {f['restore_ms']:,.0f} ms); "
            f"as suffix - 1 + 1: {f['stock_split_forwards_ms']:,.0f} / {f['split_forwards_ms']:,.0f} ms")
    for mode, t in result.get("targets", {}).items():
        lines.append(f"{mode}: warm TTFT / faster forward = {t['ratio']}x (stock forward {t['stock_forward_ms']:,.0f} ms, "
                     f"patched forward {t['patched_forward_ms']:,.0f} ms; target <= 1.3x)")
    return lines


def copies_lines(result: dict[str, Any]) -> list[str]:
    out = []
    for mode in result["modes"]:
        ops = ", ".join(f"{k} {v / 1e6:,.1f}" for k, v in result["summary"][mode].get("copies_by_op", {}).items() if v)
        out.append(f"{mode} copies per warm turn, MB by op: {ops or 'none'}")
    return out


def render(result: dict[str, Any]) -> str:
    return "\n".join([*summary_table(result), "", *turns_table(result), "", *forward_lines(result),
                      *copies_lines(result)])
