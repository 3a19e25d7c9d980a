"""Segment checkpoints in the replay: the first-sight trace, its shapes, and the numbers.

Token counts only (no wall clock). The bundled traces are replayed at glm5_next's full size.
"""

from __future__ import annotations

import numpy as np
import pytest

from apcctl.lab.sim import tracegen_firstsight as fs
from apcctl.lab.sim.replay import replay, replay_policy
from apcctl.lab.sim.report import summarize
from apcctl.lab.sim.tracegen_firstsight import bundled_firstsight_path
from apcctl.lab.sim.sizes import load_sizes
from apcctl.lab.sim.trace import bundled_trace_path, encode, parse_lines, read_trace
from apcctl.lab.sim.conversation import SYSTEM, USER
from server_patch.lineage.lookup import common_prefix_len
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb


@pytest.fixture(scope="module")
def sizes():
    return load_sizes("full")


@pytest.fixture(scope="module")
def trace():
    return fs.generate(seed=7, scale="full", minutes=30)[0]


def first_of(requests, agent):
    return next(r for r in requests if r.conv.startswith(agent + "/"))


# ----------------------------------------------------------------------------- the generator


def test_same_seed_same_trace_and_the_bundled_files_are_seed_7():
    a, meta = fs.generate(seed=5, scale="tiny", minutes=10)
    b, _ = fs.generate(seed=5, scale="tiny", minutes=10)
    assert list(encode(a, meta)) == list(encode(b, meta))
    for tools in (False, True):
        requests, meta = fs.generate(seed=7, scale="full", minutes=30, tool_boundaries=tools)
        bundled = read_trace(bundled_firstsight_path(tools))
        assert bundled.meta["tool_boundaries"] is tools
        assert [r.tokens.tolist() for r in bundled.requests] == [r.tokens.tolist() for r in requests]
        assert [r.segments for r in bundled.requests] == [r.segments for r in requests]


def test_every_first_sight_divergence_is_where_the_brief_puts_it(trace):
    agents = fs.make_agents(7, fs.SCALES["full"])
    ops, mcp, lite, helper = (first_of(trace, n) for n in ("ops", "ops-mcp", "ops-lite", "ops-helper"))
    tools_end = 3 + sum(len(t) for t in agents["ops"].tools)
    # MCP tools appended: parts from ops exactly at its tools end (a segment of ops).
    assert common_prefix_len(mcp.tokens, ops.tokens) == tools_end and tools_end in ops.segments
    # A helper with ops's tools and its own system text: shares the tools and the <|system|>.
    assert common_prefix_len(helper.tokens, ops.tokens) == tools_end + 1
    # The lite agent shares ops's first 6 tools only.
    six = 3 + sum(len(t) for t in agents["ops"].tools[:6])
    assert common_prefix_len(lite.tokens, ops.tokens) == six
    # Writer variants differ in their 4th paragraph, after the tools block.
    a, b = first_of(trace, "writer-a"), first_of(trace, "writer-b")
    shared = common_prefix_len(a.tokens, b.tokens)
    writer_tools_end = 3 + sum(len(t) for t in agents["writer-a"].tools)
    assert writer_tools_end + 1 + 1000 < shared < a.anchor_len
    # The sub-agent with ops's system text but its own tools shares only the template head.
    assert common_prefix_len(first_of(trace, "ops-sub").tokens, ops.tokens) == 3


def test_the_clock_changes_every_minute_and_stays_out_of_the_anchor(trace):
    ops = [r for r in trace if r.agent == "ops"]
    anchors = {r.anchor_len for r in ops}
    assert len(anchors) == 1  # the trailing time message is shorter than the anchor tail
    minutes = {int(r.t // 60) for r in ops}
    stamps = {tuple(r.tokens[r.anchor_len:r.anchor_len + 10]) for r in ops}
    assert len(stamps) == len(minutes) > 5
    (anchor,) = anchors
    # mlx-vlm joins the time message to the system text with "\n\n": the anchor is that
    # paragraph break, 2 tokens early (plain text, BPE slack), and a segment.
    assert all(r.tokens[anchor + fs.PARAGRAPH_SLACK - 1] == fs.PARAGRAPH and anchor in r.segments for r in ops)
    stamp = [r for r in trace if r.agent == "stamp"]
    assert len({tuple(r.tokens[:r.anchor_len]) for r in stamp}) == len({int(r.t // 60) for r in stamp})


def test_segments_are_tools_end_content_start_system_ends_and_message_starts(trace):
    for req in trace:
        segs = set(req.segments)
        assert req.anchor_len in segs
        pos = req.anchor_len
        # every role token after the system prefix starts a message; each start is a segment
        starts = [i for i in range(pos, req.n - 1) if req.tokens[i] in (USER, fs.ASSISTANT)]
        assert set(starts) <= segs | {req.n - 1}
        # the tools end is right before the system message's <|system|>, the content start after
        tools_end = min(s for s in segs)
        assert req.tokens[tools_end] == SYSTEM and tools_end + 1 in segs
    tooled = fs.generate(seed=7, scale="full", minutes=30, tool_boundaries=True)[0]
    agents = fs.make_agents(7, fs.SCALES["full"])
    ops = first_of(tooled, "ops")
    ends = np.cumsum([len(t) for t in agents["ops"].tools]) + 3
    assert set(int(e) - fs.TOOL_SLACK for e in ends) <= set(ops.segments)


# ----------------------------------------------------------------------------- the numbers


@pytest.fixture(scope="module")
def firstsight_runs(sizes):
    loaded = read_trace(bundled_firstsight_path())
    requests = loaded.in_time_order()
    runs = replay(loaded, ["lineage", "lineage-nosegments", "stock", "oracle"], sizes)
    return requests, {r.name: r for r in runs}, summarize(runs, requests, sizes, 420.0)


def test_segments_cut_prefill_on_first_sight_divergences_for_bounded_checkpoint_bytes(firstsight_runs):
    _, runs, summary = firstsight_runs
    lineage, nosegments, oracle = runs["lineage"], runs["lineage-nosegments"], runs["oracle"]
    assert lineage.prefill_tokens < 0.85 * nosegments.prefill_tokens
    assert lineage.prefill_tokens <= 1.07 * oracle.prefill_tokens
    # "What the post's design holds" = lineage-nosegments: the same storage and events, no segments.
    assert lineage.checkpoint_end <= 1.5 * nosegments.checkpoint_end
    row = {p["policy"]: p for p in summary["policies"]}
    assert row["lineage"]["below_stock"]["count"] == 0


def test_first_sight_requests_restore_at_another_lineages_segment(firstsight_runs):
    """A first prompt sharing a segment-aligned prefix with another agent restores there."""
    requests, runs, _ = firstsight_runs
    lineage, nosegments = runs["lineage"], runs["lineage-nosegments"]
    first = {}
    for i, req in enumerate(requests):
        first.setdefault(req.conv.split("/")[0], i)
    for agent, sibling in (("ops-mcp", "ops"), ("ops-helper", "ops"), ("writer-b", "writer-a"),
                           ("writer-c", "writer-a")):
        i = first[agent]
        tools_end = min(requests[first[sibling]].segments)  # the sibling's tools end
        assert first[sibling] < i and lineage.reused[i] >= tools_end, (agent, lineage.reused[i], tools_end)
        if agent != "writer-c":  # writer-c finds writer-b's divergence from writer-a, further on
            assert lineage.reused[i] == tools_end
        if agent.startswith("ops"):  # (the writers' tools end is also stamp's divergence point)
            assert nosegments.reused[i] < tools_end
    assert lineage.sources["ram:segment"] >= 4


def shipped(requests, sizes, names):
    """The oracle and each named policy of the replay over ``requests``."""
    return {name: replay_policy(name, requests, sizes) for name in ("oracle", *names)}


def test_tool_boundaries_pay_off_with_anchor_spread_thinning(sizes):
    """Anchors thin their boundaries by spread, so tool boundaries never crowd out the tools end."""
    requests = read_trace(bundled_firstsight_path(tool_boundaries=True)).in_time_order()
    results = shipped(requests, sizes, ("lineage", "lineage-nosegments"))
    oracle = results["oracle"].prefill_tokens
    plain = replay_policy("lineage", read_trace(bundled_firstsight_path()).in_time_order(), sizes)
    # The shipped policy's anchors thin by spread (the what-if this test measured is adopted).
    spread = results["lineage"]
    assert spread.prefill_tokens <= 1.03 * oracle and spread.prefill_tokens < plain.prefill_tokens
    assert spread.checkpoint_end <= 1.5 * results["lineage-nosegments"].checkpoint_end
    # ops-lite (first 6 tools shared) restores at the 6th tool's end, 2 tokens early
    lite = next(i for i, r in enumerate(requests) if r.conv.startswith("ops-lite/"))
    assert results["oracle"].reused[lite] - spread.reused[lite] == fs.TOOL_SLACK


def test_agent_trace_meets_the_prefill_target_with_divergence_min_gain_64(sizes):
    requests = read_trace(bundled_trace_path()).in_time_order()
    results = shipped(requests, sizes, ("lineage", "lineage-nosegments"))
    oracle = results["oracle"].prefill_tokens
    lineage = results["lineage"]  # divergence_min_gain=64 is the shipped default
    assert lineage.prefill_tokens <= 1.02 * oracle
    assert lineage.checkpoint_end <= 1.5 * results["lineage-nosegments"].checkpoint_end


def test_trace_round_trips_through_the_file_format(trace):
    again = parse_lines(list(encode(trace, {"generator": "x"}))).requests
    assert [(r.anchor_len, r.segments, r.tokens.tolist()) for r in again] == \
        [(r.anchor_len, r.segments, r.tokens.tolist()) for r in trace]
