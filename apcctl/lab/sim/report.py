"""Turn policy runs into numbers: a JSON-ready summary and rich tables for people.

Ratios: prefill tokens against the two oracles (``oracle``: the best any cache of prompts could
do on this trace; ``seen-oracle``: the same with each request's generated reply kept too) and
disk bytes written against stock 0.7.10. A ratio is None when its reference policy was not run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from apcctl.lab.sim.replay import PolicyRun
from apcctl.lab.sim.sizes import StateSizes
from apcctl.lab.sim.trace import Request

REGRESSION_SAMPLES = 10


def summarize(runs: list[PolicyRun], requests: list[Request], sizes: StateSizes,
              prefill_rate: float, trace_name: str = "") -> dict[str, Any]:
    """Everything the tables show, plus per-request regressions against stock."""
    by_name = {run.name: run for run in runs}
    oracle, stock, seen = by_name.get("oracle"), by_name.get("stock"), by_name.get("seen-oracle")
    policies = []
    for run in runs:
        ttft = run.ttft(prefill_rate)
        row: dict[str, Any] = {
            "policy": run.name,
            "requests": len(run.reused),
            "prompt_tokens": sum(run.prompt_lens),
            "prefill_tokens": run.prefill_tokens,
            "reused_tokens": run.reused_tokens,
            "prefill_vs_oracle": _ratio(run.prefill_tokens, oracle.prefill_tokens if oracle else None),
            "prefill_vs_seen": _ratio(run.prefill_tokens, seen.prefill_tokens if seen else None),
            "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else 0.0,
            "ttft_p95_s": float(np.percentile(ttft, 95)) if len(ttft) else 0.0,
            "ttft_total_s": float(ttft.sum()),
            **run.ledger.as_dict(),
            "disk_vs_stock": _ratio(run.ledger.disk_bytes_written,
                                    stock.ledger.disk_bytes_written if stock else None),
            "ram_end": run.ram_end,
            "ram_peak": run.ram_peak,
            "disk_end": run.disk_end,
            "checkpoint_bytes": run.checkpoint_end,
            "sources": dict(sorted(run.sources.items())),
            "wall_s": round(run.wall_s, 3),
        }
        if stock is not None and run is not stock:
            row["below_stock"] = _below(run, stock, requests)
        row.update(run.extra)
        policies.append(row)
    return {
        "trace": trace_name,
        "requests": len(requests),
        "prompt_tokens": sum(r.n for r in requests),
        "prefill_rate": prefill_rate,
        "sizes": sizes.describe(),
        "policies": policies,
    }


def _ratio(value: int, reference: int | None) -> float | None:
    if reference is None:
        return None
    return float("inf") if reference == 0 and value else (value / reference if reference else 1.0)


def _below(run: PolicyRun, stock: PolicyRun, requests: list[Request]) -> dict[str, Any]:
    """Requests where ``run`` restored fewer tokens than stock did."""
    worse = [(req, mine, theirs) for req, mine, theirs in zip(requests, run.reused, stock.reused)
             if mine < theirs]
    return {
        "count": len(worse),
        "tokens": sum(theirs - mine for _, mine, theirs in worse),
        "samples": [{"index": req.index, "conv": req.conv, "kind": req.kind, "n": req.n,
                     "reused": mine, "stock_reused": theirs}
                    for req, mine, theirs in worse[:REGRESSION_SAMPLES]],
    }


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}×"


def sizes_table(sizes: StateSizes) -> Table:
    table = Table(title=f"State sizes ({sizes.name})", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    rows = [
        ("layers", f"{sizes.attention_layers} attention / {sizes.linear_layers} KDA",
         f"{sizes.full_indexer_layers} with their own indexer"),
        ("latent KV / token", fmt_bytes(sizes.latent_per_token), "kv_lora_rank × dtype × attention layers"),
        ("index flags / token", fmt_bytes(sizes.index_valid_per_token), "1 byte × indexer layers"),
        ("pooled keys / token", fmt_bytes(sizes.pooled_keys_per_token), "index_head_dim × dtype / kpool"),
        ("stored KV / token", fmt_bytes(sizes.kv_per_token), "what lineage keeps"),
        ("projected / token", fmt_bytes(sizes.projected_per_token),
         f"derived; stock stores it up to {sizes.projected_max_tokens} tokens"),
        ("recurrent snapshot", fmt_bytes(sizes.recurrent_bytes), "KDA state, float32"),
        ("conv state", fmt_bytes(sizes.conv_bytes), "(kernel − 1) × 3 × heads × head_dim"),
        ("checkpoint", fmt_bytes(sizes.snapshot_bytes), "recurrent + conv, any length"),
        ("stock snapshot @10k", fmt_bytes(sizes.full_snapshot_bytes(10_000)), "KV + projected + checkpoint"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def prefill_table(summary: dict[str, Any]) -> Table:
    rate = summary["prefill_rate"]
    table = Table(title=f"Prefill ({summary['requests']} requests, {summary['prompt_tokens']:,} prompt "
                        f"tokens, TTFT at {rate:g} tok/s)", title_justify="left")
    for name in ("policy", "prefill tok", "× oracle", "× seen", "reused tok", "TTFT p50", "TTFT p95",
                 "TTFT total", "below stock"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for row in summary["policies"]:
        below = row.get("below_stock")
        table.add_row(
            row["policy"], f"{row['prefill_tokens']:,}", _fmt_ratio(row["prefill_vs_oracle"]),
            _fmt_ratio(row["prefill_vs_seen"]),
            f"{row['reused_tokens']:,}", f"{row['ttft_p50_s']:.2f} s", f"{row['ttft_p95_s']:.1f} s",
            f"{row['ttft_total_s']:.0f} s", "—" if below is None else str(below["count"]),
        )
    return table


def state_table(summary: dict[str, Any]) -> Table:
    table = Table(title="State", title_justify="left")
    for name in ("policy", "cloned", "disk written", "× stock", "RAM end", "RAM peak", "disk end",
                 "checkpoints", "evictions"):
        table.add_column(name, justify="left" if name == "policy" else "right")
    for row in summary["policies"]:
        evictions = str(row["evictions"])
        if row["anchor_evictions"]:
            evictions += f" (+{row['anchor_evictions']} anchors)"
        table.add_row(
            row["policy"], fmt_bytes(row["bytes_cloned"]), fmt_bytes(row["disk_bytes_written"]),
            _fmt_ratio(row["disk_vs_stock"]), fmt_bytes(row["ram_end"]), fmt_bytes(row["ram_peak"]),
            fmt_bytes(row["disk_end"]), fmt_bytes(row["checkpoint_bytes"]), evictions,
        )
    return table


def print_report(summary: dict[str, Any], sizes: StateSizes, console: Console | None = None) -> None:
    """Three tables; piped output gets 130 columns so the rows stay on one line each."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=130)
    console.print(sizes_table(sizes))
    console.print(prefill_table(summary))
    console.print(state_table(summary))
