"""The replay loop over every policy: totals, bounds, lineage against stock, the CLI."""

from __future__ import annotations

import json

import click
import numpy as np
import pytest
from click.testing import CliRunner

from apcctl.commands import bench_replay
from apcctl.lab.sim.policies import POLICY_NAMES
from apcctl.lab.sim.policies.oracle import OraclePolicy
from apcctl.lab.sim.replay import replay
from apcctl.lab.sim.sizes import load_sizes, ram_to_hold
from apcctl.lab.sim.trace import Request, Trace, bundled_trace_path, read_trace, write_trace
from apcctl.lab.sim.tracegen import generate
from server_patch.lineage import LineageConfig
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb


@click.group()
def main() -> None:
    """Only this module's commands: other command modules may be mid-change in the tree."""


@main.group()
def bench() -> None:
    """The ``bench`` group, as apcctl.cli builds it."""


bench_replay.register(main, bench)


@pytest.fixture(scope="module")
def tiny_trace() -> Trace:
    requests, meta = generate(seed=5, scale="tiny", minutes=20)
    return Trace(requests, meta)


@pytest.fixture(scope="module")
def tiny_runs(tiny_trace):
    return {run.name: run for run in replay(tiny_trace, POLICY_NAMES, load_sizes("tiny"))}


def test_oracle_reuses_the_longest_prefix_shared_with_any_earlier_prompt():
    oracle = OraclePolicy()
    arr = lambda *ids: np.asarray(ids, dtype=np.int32)  # noqa: E731
    assert oracle.serve(Request("a", 0, arr(1, 2, 3, 4))).reused == 0
    assert oracle.serve(Request("b", 1, arr(1, 2, 9, 9, 9))).reused == 2
    assert oracle.serve(Request("c", 2, arr(1, 2, 9, 9, 7))).reused == 4
    assert oracle.serve(Request("a", 3, arr(1, 2, 3, 4))).reused == 3  # capped at n - 1


def test_reused_plus_computed_is_the_prompt_for_every_policy(tiny_trace, tiny_runs):
    lengths = [r.n for r in tiny_trace.in_time_order()]
    for run in tiny_runs.values():
        assert run.prompt_lens == lengths
        assert all(0 <= reused <= n - 1 for reused, n in zip(run.reused, lengths))
        assert run.prefill_tokens + run.reused_tokens == tiny_trace.prompt_tokens
        assert sum(run.sources.values()) == len(lengths)


# Policies that keep generated replies (lineage: reply reuse, on by default): bounded by the
# seen oracle only; every other policy is bounded by the prompt oracle too.
KEEP_REPLIES = {"seen-oracle", "lineage", "lineage-nosegments", "lineage-nodrift"}


def test_no_policy_beats_the_oracle_on_any_request(tiny_runs):
    """Nothing beats the seen oracle, and it beats the prompt oracle."""
    oracle, seen = tiny_runs["oracle"].reused, tiny_runs["seen-oracle"].reused
    for run in tiny_runs.values():
        assert all(mine <= best for mine, best in zip(run.reused, seen)), run.name
        if run.name not in KEEP_REPLIES:
            assert all(mine <= best for mine, best in zip(run.reused, oracle)), run.name
    assert tiny_runs["seen-oracle"].prefill_tokens < tiny_runs["oracle"].prefill_tokens


def test_lineage_without_reply_reuse_is_bounded_by_the_prompt_oracle(tiny_trace, tiny_runs):
    """``reply_reuse=False`` is the behaviour before it: no restore past any prompt, and never
    more tokens than with it on the same trace."""
    off = replay(tiny_trace, ["lineage"], load_sizes("tiny"), LineageConfig(reply_reuse=False))[0]
    oracle, on = tiny_runs["oracle"].reused, tiny_runs["lineage"].reused
    assert all(mine <= best for mine, best in zip(off.reused, oracle))
    assert off.prefill_tokens > tiny_runs["lineage"].prefill_tokens
    assert all(a <= b for a, b in zip(off.reused, on))


def test_the_seen_oracle_restores_past_each_verbatim_reply():
    """Three turns of one conversation: the seen oracle beats the prompt oracle by each reply's length."""
    arr = lambda *ids: np.asarray(ids, dtype=np.int32)  # noqa: E731
    p0, r0 = arr(*range(100, 110)), arr(*range(200, 205))
    p1 = np.concatenate([p0, r0, arr(300, 301, 302)])
    r1 = arr(*range(400, 407))
    p2 = np.concatenate([p1, r1, arr(500, 501)])
    trace = Trace([Request("c", 0, p0, reply=r0, reply_verbatim=True, index=0),
                   Request("c", 1, p1, reply=r1, reply_verbatim=True, index=1),
                   Request("c", 2, p2, reply=arr(600), index=2)])
    runs = {run.name: run for run in replay(trace, ["oracle", "seen-oracle"], load_sizes("tiny"))}
    assert runs["oracle"].reused == [0, p0.shape[0], p1.shape[0]]
    assert runs["seen-oracle"].reused == [0, p0.shape[0] + r0.shape[0], p1.shape[0] + r1.shape[0]]
    assert runs["oracle"].prefill_tokens - runs["seen-oracle"].prefill_tokens == r0.shape[0] + r1.shape[0]


@pytest.mark.parametrize("name", ["lineage", "lineage-nosegments"])
def test_lineage_reuses_at_least_what_stock_does_on_every_request(tiny_trace, tiny_runs, name):
    requests = tiny_trace.in_time_order()
    worse = [(requests[i].index, requests[i].conv, requests[i].kind, mine, theirs)
             for i, (mine, theirs) in enumerate(zip(tiny_runs[name].reused, tiny_runs["stock"].reused))
             if mine < theirs]
    assert worse == [], f"{name} restored less than stock on: {worse}"


def test_lineage_holds_less_and_writes_less_than_stock(tiny_runs):
    lineage, stock = tiny_runs["lineage"], tiny_runs["stock"]
    assert lineage.ledger.disk_bytes_written < stock.ledger.disk_bytes_written
    assert lineage.ledger.evictions == 0


def test_replay_json_on_a_trace_file(tmp_path, tiny_trace):
    path = tmp_path / "t.jsonl"
    write_trace(path, tiny_trace.requests, tiny_trace.meta)
    result = CliRunner().invoke(main, ["bench", "replay", str(path), "--model-config", "tiny",
                                       "--policy", "lineage,stock,oracle", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    rows = {row["policy"]: row for row in summary["policies"]}
    assert rows["oracle"]["prefill_vs_oracle"] == 1.0 and rows["stock"]["disk_vs_stock"] == 1.0
    assert rows["oracle"]["prefill_vs_seen"] is None  # seen-oracle was not run
    assert rows["lineage"]["below_stock"]["count"] == 0
    assert summary["sizes"]["kv_per_token"] == 133


def test_replay_human_output_and_bad_options(tmp_path, tiny_trace):
    path = tmp_path / "t.jsonl"
    write_trace(path, tiny_trace.requests[:20], tiny_trace.meta)
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "replay", str(path), "--model-config", "tiny"])
    assert result.exit_code == 0 and "lineage-nosegments" in result.output and "× oracle" in result.output
    assert "× seen" in result.output and "seen-oracle" in result.output
    assert runner.invoke(main, ["bench", "replay", str(path), "--policy", "lru"]).exit_code != 0
    bad = runner.invoke(main, ["bench", "replay", str(path), "--lineage-config", "nope=1"])
    assert bad.exit_code != 0 and "nope" in bad.output


def test_trace_gen_command_writes_a_replayable_trace(tmp_path):
    out = tmp_path / "g.jsonl"
    result = CliRunner().invoke(main, ["bench", "trace-gen", str(out), "--scale", "tiny",
                                       "--minutes", "5", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert "requests" in result.output and out.stat().st_size > 0


@pytest.fixture(scope="module")
def bundled_summary():
    result = CliRunner().invoke(main, ["bench", "replay", "--json"])
    assert result.exit_code == 0, result.output
    return {row["policy"]: row for row in json.loads(result.output)["policies"]}


def test_bundled_trace_lineage_disk_target(bundled_summary):
    """docs/benchmarks-replay.md: <= 0.2x stock's disk bytes, never below stock."""
    lineage = bundled_summary["lineage"]
    assert lineage["disk_vs_stock"] <= 0.2
    assert lineage["below_stock"]["count"] == 0


def test_bundled_trace_evicts_no_conversation_with_the_ram_it_needs():
    """With a RAM budget that holds every branch of the trace at once (sized from the trace's
    tokens and the state's bytes, ``sizes.ram_to_hold``), no conversation is evicted."""
    config = LineageConfig()
    budget = ram_to_hold(read_trace(bundled_trace_path()).in_time_order(), load_sizes("full"),
                         config.max_checkpoints, config.anchor_max_bytes)
    result = CliRunner().invoke(main, ["bench", "replay", "--json", "--policy", "lineage",
                                       "--lineage-config", f"ram_budget_bytes={budget}"])
    assert result.exit_code == 0, result.output
    lineage = json.loads(result.output)["policies"][0]
    assert lineage["evictions"] == 0 and lineage["ram_peak"] <= budget


def test_bundled_trace_lineage_prefill_target(bundled_summary):
    """Issue 13: with reply reuse, <= 1.05x the seen oracle (so also below the prompt oracle)."""
    assert bundled_summary["lineage"]["prefill_vs_seen"] <= 1.05
    assert bundled_summary["lineage"]["prefill_vs_oracle"] <= 1.0


def test_bundled_trace_seen_oracle_is_below_the_prompt_oracle(bundled_summary):
    """The replies the trace carries are most of what a warm turn still prefills."""
    seen, oracle = bundled_summary["seen-oracle"], bundled_summary["oracle"]
    assert seen["prefill_vs_seen"] == 1.0
    assert seen["prefill_tokens"] < 0.7 * oracle["prefill_tokens"]
