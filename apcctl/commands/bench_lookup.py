"""``apcctl bench lookup``: the lineage lookup's cost over many long entries."""

from __future__ import annotations

import json
import time

import click
import numpy as np


def measure(entries: int, tokens: int, shared: int, repeats: int) -> dict[str, float]:
    """Time ``LineageCache.lookup`` against ``entries`` stored prompts of ``tokens`` tokens."""
    from server_patch.lineage import LineageCache, LineageConfig, SizedKV, SizedSnapshot

    rng = np.random.RandomState(0)
    prefix = rng.randint(0, 150_000, shared)
    cache = LineageCache(LineageConfig(ram_budget_bytes=1 << 60, periodic_stride=0))
    for i in range(entries):
        prompt = np.concatenate([prefix, rng.randint(0, 150_000, tokens - shared)])
        cache.commit(prompt, kv=SizedKV(1, tokens - 1), head=SizedSnapshot(1))
    probe = np.concatenate([prefix, rng.randint(0, 150_000, tokens - shared)])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cache.lookup(probe)
        times.append((time.perf_counter() - start) * 1000)
    return {"entries": entries, "tokens": tokens, "shared": shared,
            "median_ms": float(np.median(times)), "max_ms": float(np.max(times))}


@click.command("lookup")
@click.option("--entries", default=300, show_default=True, help="Stored lineage entries.")
@click.option("--tokens", default=100_000, show_default=True, help="Tokens per entry.")
@click.option("--shared", default=10_000, show_default=True, help="Prefix every entry shares.")
@click.option("--repeats", default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def bench_lookup(entries: int, tokens: int, shared: int, repeats: int, as_json: bool) -> None:
    """Lookup time against ENTRIES stored prompts of TOKENS tokens (numpy prefix compare)."""
    result = measure(entries, tokens, shared, repeats)
    worst = measure(entries, tokens, tokens - 200, max(3, repeats // 4))
    if as_json:
        click.echo(json.dumps({"typical": result, "all_shared": worst}))
        return
    click.echo(f"{entries} entries x {tokens} tokens, {shared} shared: "
               f"median {result['median_ms']:.2f} ms, max {result['max_ms']:.2f} ms")
    click.echo(f"worst case (every entry shares {tokens - 200} tokens): "
               f"median {worst['median_ms']:.2f} ms, max {worst['max_ms']:.2f} ms")


def register(main: click.Group, bench: click.Group) -> None:
    bench.add_command(bench_lookup)
