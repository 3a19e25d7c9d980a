"""``apcctl bench lookup``: the lineage lookup's cost over many long entries."""

from __future__ import annotations

import json
import time
from typing import Any

import click
import numpy as np


def _lookup_times(cache: Any, probe: np.ndarray, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` lookups of ``probe``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cache.lookup(probe)
        times.append((time.perf_counter() - start) * 1000)
    return times


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
    times = _lookup_times(cache, probe, repeats)
    return {"entries": entries, "tokens": tokens, "shared": shared,
            "median_ms": float(np.median(times)), "max_ms": float(np.max(times))}


def measure_fleet(servers: int, entries: int, tokens: int, shared: int, repeats: int) -> dict[str, float]:
    """Time a lookup that finds nothing better in RAM and consults ``servers - 1`` peers'
    indexes of ``entries`` files each (issue 38): the peers' last scan, no I/O in the lookup."""
    from server_patch.lineage import LineageCache, LineageConfig
    from server_patch.lineage.model import DiskRecord

    rng = np.random.RandomState(0)
    prefix = rng.randint(0, 150_000, shared)

    def record(i: int) -> DiskRecord:
        prompt = np.concatenate([prefix, rng.randint(0, 150_000, tokens - shared)])
        return DiskRecord(id=f"p{i}", tokens=prompt, namespace="", checkpoints=((shared, "segment"),),
                          nbytes=1, last_used=0.0)

    class Peers:
        def __init__(self, records: tuple[DiskRecord, ...]) -> None:
            self._records = records

        def records(self) -> tuple[DiskRecord, ...]:
            return self._records

    class Tier:  # our own disk index: ``entries`` files; the peers': the rest
        def __init__(self) -> None:
            self.own = [record(i) for i in range(entries)]
            self.peers = Peers(tuple(record(entries + i) for i in range((servers - 1) * entries)))

        def records(self) -> list[DiskRecord]:
            return self.own

    cache = LineageCache(LineageConfig(ram_budget_bytes=1 << 60, periodic_stride=0), disk=Tier())
    probe = np.concatenate([prefix, rng.randint(0, 150_000, tokens - shared)])
    times = _lookup_times(cache, probe, repeats)
    return {"servers": servers, "files": servers * entries, "median_ms": float(np.median(times)),
            "max_ms": float(np.max(times))}


def measure_shadow(entries: int, tokens: int, shared: int, repeats: int, budget: int) -> dict[str, float]:
    """Time the live oracle's part of a lookup (hash the prompt's blocks, match them) with the
    shadow index filled by the same ``entries`` prompts, within ``budget`` bytes; and what it
    holds per million tokens."""
    from server_patch.lineage.shadow import ShadowIndex

    rng = np.random.RandomState(0)
    prefix = rng.randint(0, 150_000, shared)
    shadow = ShadowIndex(budget)
    for _ in range(entries):
        prompt = np.concatenate([prefix, rng.randint(0, 150_000, tokens - shared)])
        shadow.add(shadow.hashes(prompt), "")
    probe = np.concatenate([prefix, rng.randint(0, 150_000, tokens - shared)])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        shadow.match(shadow.hashes(probe), "", tokens)
        times.append((time.perf_counter() - start) * 1000)
    held_tokens = len(shadow) * shadow.block
    return {"budget_bytes": budget, "blocks": len(shadow), "bytes": shadow.nbytes,
            "bytes_per_million_tokens": shadow.nbytes / held_tokens * 1e6 if held_tokens else 0.0,
            "median_ms": float(np.median(times)), "max_ms": float(np.max(times))}


@click.command("lookup")
@click.option("--entries", default=300, show_default=True, help="Stored lineage entries.")
@click.option("--tokens", default=100_000, show_default=True, help="Tokens per entry.")
@click.option("--shared", default=10_000, show_default=True, help="Prefix every entry shares.")
@click.option("--repeats", default=20, show_default=True)
@click.option("--shadow-bytes", default=None, type=int,
              help="The live oracle's shadow budget (default: APC_LINEAGE_SHADOW_BUDGET_BYTES's default).")
@click.option("--servers", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Servers sharing a disk tier: the lookup also reads SERVERS-1 peers' indexes of ENTRIES files.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def bench_lookup(entries: int, tokens: int, shared: int, repeats: int, shadow_bytes: int | None,
                 servers: int, as_json: bool) -> None:
    """Lookup time against ENTRIES stored prompts of TOKENS tokens (numpy prefix compare), and
    what the live oracle's shadow index adds to it (block hashes and a binary search)."""
    from server_patch.lineage import LineageConfig

    result = measure(entries, tokens, shared, repeats)
    worst = measure(entries, tokens, tokens - 200, max(3, repeats // 4))
    budget = LineageConfig().shadow_budget_bytes if shadow_bytes is None else shadow_bytes
    shadow = measure_shadow(entries, tokens, shared, repeats, budget)
    fleet = measure_fleet(servers, entries, tokens, shared, repeats) if servers > 1 else None
    if as_json:
        click.echo(json.dumps({"typical": result, "all_shared": worst, "shadow": shadow,
                               **({"fleet": fleet} if fleet else {})}))
        return
    if fleet:
        click.echo(f"shared disk tier, {servers} servers x {entries} files ({fleet['files']} indexed, none "
                   f"in RAM): median {fleet['median_ms']:.2f} ms, max {fleet['max_ms']:.2f} ms")
    click.echo(f"{entries} entries x {tokens} tokens, {shared} shared: "
               f"median {result['median_ms']:.2f} ms, max {result['max_ms']:.2f} ms")
    click.echo(f"worst case (every entry shares {tokens - 200} tokens): "
               f"median {worst['median_ms']:.2f} ms, max {worst['max_ms']:.2f} ms")
    click.echo(f"live oracle (shadow index, {shadow['bytes'] / (1 << 20):.1f} MiB of "
               f"{shadow['budget_bytes'] / (1 << 20):.1f} MiB, {shadow['bytes_per_million_tokens'] / (1 << 20):.1f} "
               f"MiB per million tokens): median {shadow['median_ms']:.2f} ms, max {shadow['max_ms']:.2f} ms more")


def register(main: click.Group, bench: click.Group) -> None:
    bench.add_command(bench_lookup)
