"""The live oracle's shadow index (``server_patch.lineage.shadow``): prefix-block hashes per
namespace, the oracle's cap and rounding, the byte budget with oldest-first eviction that keeps
prefixes, and what a block really costs."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from server_patch.lineage import LineageConfig
from server_patch.lineage.shadow import BYTES_PER_BLOCK, ShadowIndex, block_hashes


def ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 150_000, n).astype(np.int32)


def seen(index: ShadowIndex, tokens: np.ndarray, namespace: str = "") -> None:
    index.add(index.hashes(tokens), namespace)


def oracle(index: ShadowIndex, tokens: np.ndarray, namespace: str = "") -> int:
    return index.match(index.hashes(tokens), namespace, int(tokens.shape[0])).oracle


def test_block_hashes_name_whole_prefixes() -> None:
    a = ids(100)
    b = a.copy()
    b[37] += 1  # differs inside the third block of 16
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha.shape == (6,)  # whole blocks only
    assert list(ha[:2]) == list(hb[:2])
    assert all(x != y for x, y in zip(ha[2:], hb[2:]))  # a chain: every later block differs too
    swapped = np.concatenate([a[16:32], a[:16], a[32:]])
    assert block_hashes(swapped, 16)[1] != ha[1]  # order matters, not only the block multiset
    assert list(block_hashes(a, 16)) == list(ha)  # deterministic


def test_oracle_is_the_longest_prefix_seen_capped_and_rounded() -> None:
    index = ShadowIndex(1 << 20, block=16)
    first = ids(200)
    assert oracle(index, first) == 0
    seen(index, first)
    assert oracle(index, first) == 192  # a resend: n - 1 = 199, rounded down to 16
    follow = np.concatenate([first, ids(50, 1)])
    assert oracle(index, follow) == 192  # all of the first prompt's whole blocks
    edited = first.copy()
    edited[100] += 1
    assert oracle(index, edited) == 96
    assert oracle(index, first[:40]) == 32  # a prefix of something seen: capped at n - 1 = 39


def test_namespaces_do_not_see_each_other_but_the_overlap_is_flagged() -> None:
    index = ShadowIndex(1 << 20, block=16)
    tokens = ids(160)
    seen(index, tokens, "tenant-a")
    other = index.match(index.hashes(tokens), "tenant-b", 160)
    assert other.oracle == 0 and other.elsewhere
    own = index.match(index.hashes(tokens), "tenant-a", 160)
    assert own.oracle == 144 and not own.elsewhere
    seen(index, tokens, "tenant-b")
    assert oracle(index, tokens, "tenant-b") == 144 and oracle(index, tokens, "tenant-a") == 144


def test_budget_evicts_oldest_first_and_keeps_prefixes() -> None:
    index = ShadowIndex(BYTES_PER_BLOCK * 20, block=16)
    old, new = ids(16 * 12, 1), ids(16 * 12, 2)
    seen(index, old)
    seen(index, new)
    assert len(index) == 20 and index.nbytes <= index.budget_bytes
    assert index.evicted_blocks == 4
    assert oracle(index, new) == 16 * 11  # the newest chain whole (capped at n - 1)
    # The old chain lost its *last* blocks, not its first: a prefix still matches.
    assert oracle(index, old) == 16 * 8
    seen(index, old[:16 * 3])  # touching a prefix makes it newest again
    seen(index, ids(16 * 9, 4))
    assert oracle(index, old) == 16 * 3 and oracle(index, new) == 16 * 8  # the oldest went: old, then new tails
    longest = ids(16 * 30, 3)
    seen(index, longest)  # longer than the budget: everything older goes, and its own tail
    assert len(index) == 20
    assert oracle(index, old) == 0 and oracle(index, longest) == 16 * 20


def test_off_holds_nothing() -> None:
    index = ShadowIndex(0)
    tokens = ids(64)
    seen(index, tokens)
    assert len(index) == 0 and oracle(index, tokens) == 0


def test_a_block_costs_what_the_budget_counts() -> None:
    """``BYTES_PER_BLOCK`` is what CPython really spends per held block (within 25 %)."""
    index = ShadowIndex(1 << 40, block=16)
    chains = [index.hashes(ids(16_000, seed)) for seed in range(8)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for hashes in chains:
            index.add(hashes, "")
        spent = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == 8000
    assert 0.75 * BYTES_PER_BLOCK <= spent / len(index) <= 1.25 * BYTES_PER_BLOCK


def test_settings_validate_the_block() -> None:
    assert LineageConfig.from_env({"APC_LINEAGE_SHADOW_BLOCK_TOKENS": "8"}).shadow_block_tokens == 8
    with pytest.raises(ValueError, match="shadow_block_tokens"):
        LineageConfig.from_env({"APC_LINEAGE_SHADOW_BLOCK_TOKENS": "0"})
    assert LineageConfig.from_env({"APC_LINEAGE_SHADOW_BUDGET_BYTES": "1M"}).shadow_budget_bytes == 1 << 20


def test_bench_lookup_reports_the_shadow_within_its_budget() -> None:
    from apcctl.commands.bench_lookup import measure_shadow

    budget = BYTES_PER_BLOCK * 500
    got = measure_shadow(entries=4, tokens=4000, shared=1000, repeats=2, budget=budget)
    assert got["blocks"] == 500 and got["bytes"] <= budget  # 4 x 250 blocks offered, the budget kept half
    assert got["bytes_per_million_tokens"] == BYTES_PER_BLOCK / 16 * 1e6


def test_journal_block_lines_carry_only_what_is_new() -> None:
    from server_patch.integration.block_lines import BlockDecoder, BlockEncoder

    encoder, decoder = BlockEncoder(), BlockDecoder()
    turn1 = block_hashes(ids(1600, 1))
    turn2 = block_hashes(np.concatenate([ids(1600, 1), ids(800, 2)]))
    other = block_hashes(ids(1600, 1))  # the same tokens in another namespace: not a base
    lines = [encoder.fields("a", turn1), encoder.fields("a", turn2), encoder.fields("b", other)]
    assert "from" not in lines[0] and "from" not in lines[2]
    assert (lines[1]["from"], lines[1]["keep"]) == (lines[0]["bseq"], 100)
    assert len(lines[1]["hashes"]) < len(lines[0]["hashes"])  # 50 new hashes, not 150
    decoded = [decoder.hashes(line) for line in lines]
    assert [list(d) for d in decoded] == [list(turn1), list(turn2), list(other)]
    late = BlockDecoder()  # a report window that starts after the base line
    assert late.hashes(lines[1]) is None and late.skipped == 1


def test_older_blocks_fill_free_room_only_and_go_first() -> None:
    index = ShadowIndex(BYTES_PER_BLOCK * 10, block=16)
    live, old = ids(16 * 4, 1), ids(16 * 8, 2)
    seen(index, live)
    assert index.add_older(index.hashes(old), "") is False  # 4 live + 8 old > 10: the room ran out
    assert len(index) == 10 and oracle(index, live) == 16 * 3  # nothing live was pushed out
    assert oracle(index, old) == 16 * 6  # a prefix of the old chain went in
    seen(index, ids(16 * 3, 3))  # live traffic pushes the old blocks out first, extensions first
    assert oracle(index, live) == 16 * 3 and oracle(index, old) == 16 * 3


def test_the_shadow_is_warmed_from_earlier_runs_of_the_same_model(tmp_path) -> None:
    import json

    from server_patch.integration.block_lines import BlockEncoder
    from server_patch.integration.shadow_warmup import warm
    from server_patch.lineage.misses import Lost, MissBook

    first, other_model, mine = ids(320, 1), ids(320, 2), ids(320, 3)
    lines = []
    for pid, fingerprint, tokens in ((1, "model-a", first), (2, "model-b", other_model), (3, "model-a", mine)):
        encoder = BlockEncoder()
        lines.append({"type": "start", "time": float(pid), "pid": pid, "fingerprint": fingerprint})
        hashes = block_hashes(tokens)
        lines.append({"type": "blocks", "time": pid + 0.5, "kind": "prompt", "namespace": "", "tokens": 320,
                      "block": 16, **encoder.fields("", hashes)})
    journal = tmp_path / "journal.jsonl"
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines))
    book = MissBook(1 << 20)
    assert warm(book, [journal], "model-a", own_start=(3, 3.0)) == 20  # the first run only: not this one
    match = book.match(book.hashes(first), "", 320)
    assert match.oracle == 304 and book.match(book.hashes(other_model), "", 320).oracle == 0
    # What the restart lost is explained: the first run's prompt end is a point that went with it.
    miss = book.explain(match, 0, book.hashes(first), "", [], Lost.OTHER)
    assert miss.lost == {Lost.RESTART: 304}
