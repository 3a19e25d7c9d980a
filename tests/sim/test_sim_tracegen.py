"""The agent trace generator: deterministic by seed, and every shape the brief asks for."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from apcctl.lab.sim.patterns import CLIENT_AGENTS as CLIENTS
from apcctl.lab.sim.trace import encode
from apcctl.lab.sim.tracegen import ANCHOR_SLACK, SCALES, USER, generate, make_personas
from server_patch.lineage.lookup import common_prefix_len


@pytest.fixture(scope="module")
def full():
    return generate(seed=7, scale="full", minutes=30)[0]


@pytest.fixture(scope="module")
def tiny():
    return generate(seed=3, scale="tiny", minutes=20)[0]


def by_conv(requests):
    convs = defaultdict(list)
    for r in requests:
        convs[r.conv].append(r)
    return convs


def test_same_seed_same_trace_other_seed_other_trace():
    a, meta = generate(seed=11, scale="tiny", minutes=10)
    b, _ = generate(seed=11, scale="tiny", minutes=10)
    c, _ = generate(seed=12, scale="tiny", minutes=10)
    assert list(encode(a, meta)) == list(encode(b, meta))
    assert list(encode(a, meta)) != list(encode(c, meta))


def test_requests_are_in_time_order_and_indexed(full):
    assert [r.t for r in full] == sorted(r.t for r in full)
    assert [r.index for r in full] == list(range(len(full)))


def test_system_prompts_are_9_to_12k_and_variants_differ_by_4_tokens_near_the_end():
    personas = make_personas(7, SCALES["full"])
    for name in ("carmen", "carmen-sched", "coder-a", "coder-b"):
        p = personas[name]
        assert 9_000 <= len(p.tools) + len(p.system) + 4 <= 12_000
    a, b = personas["coder-a"].system, personas["coder-b"].system
    assert a.shape == b.shape and np.array_equal(personas["coder-a"].tools, personas["coder-b"].tools)
    differ = np.flatnonzero(a != b)
    assert len(differ) == 4 and differ[-1] - differ[0] == 3
    assert len(a) - 64 < differ[0] and differ[-1] < len(a) - ANCHOR_SLACK  # before the anchor


def test_both_variants_appear_and_share_a_prefix_up_to_the_difference(full):
    firsts = {r.conv: r for r in reversed(full) if r.agent == "coder"}
    a, b = firsts["coder/s0"], firsts["coder/s1"]
    shared = common_prefix_len(a.tokens, b.tokens)
    assert a.anchor_len - 64 < shared < a.anchor_len


def test_timestamp_changes_every_minute_and_only_the_timestamp(full):
    sched = [r for r in full if r.agent == "carmen-sched"]
    assert len({int(r.t // 60) for r in sched}) >= 5
    for x, y in zip(sched, sched[1:]):
        same_minute = int(x.t // 60) == int(y.t // 60)
        head = min(x.anchor_len, y.anchor_len)
        differ = np.flatnonzero(x.tokens[:head] != y.tokens[:head])
        if same_minute:
            assert len(differ) == 0
        else:
            assert 1 <= len(differ) <= 4 and differ[0] > x.segments[0]  # inside the system text


def test_resends_are_identical_and_an_edit_rewrites_only_the_last_message(full):
    kinds = {r.kind for r in full}
    assert {"retry", "regenerate", "edit", "new_session", "subagent", "scheduled"} <= kinds
    for conv in by_conv(full).values():
        for prev, cur in zip(conv, conv[1:]):
            if cur.kind in ("retry", "regenerate"):
                assert np.array_equal(prev.tokens, cur.tokens)
            elif cur.kind == "edit":
                last_start = cur.segments[-1]
                assert last_start == prev.segments[-1]
                assert common_prefix_len(prev.tokens, cur.tokens) >= last_start + 1
                assert not np.array_equal(prev.tokens, cur.tokens)


def test_each_turn_resends_the_whole_conversation_including_the_reply(full):
    for conv in by_conv(full).values():
        if conv[0].agent == "carmen-sched" or conv[0].agent.startswith(CLIENTS):
            continue  # its clock moves under it; the clients' patterns: tests/lineage/test_agent_patterns.py
        for prev, cur in zip(conv, conv[1:]):
            if cur.kind == "turn":
                assert common_prefix_len(prev.tokens, cur.tokens) == prev.n
                assert cur.n - prev.n > 30  # a reply plus a question


def test_questions_are_7_to_50_tokens(full):
    for r in full:
        if r.agent == "carmen" and r.kind in ("turn", "new_session"):
            last = r.tokens[r.segments[-1]:-1]
            assert last[0] == USER and 7 <= len(last) - 1 <= 50


def test_subagents_share_the_system_text_but_not_the_tools(full):
    personas = make_personas(7, SCALES["full"])
    sub = next(r for r in full if r.kind == "subagent")
    parent = next(r for r in full if r.agent == "coder")
    tools_end, system_end = sub.segments[0], sub.segments[1]
    assert np.array_equal(sub.tokens[tools_end + 1:system_end], personas["coder-a"].system)
    assert common_prefix_len(sub.tokens, parent.tokens) == 3  # [gMASK]<sop><|system|> only
    assert sum(r.kind == "subagent" for r in full) >= 4


def test_anchor_and_segments_describe_the_template(full):
    for r in full:
        tools_end, system_end, *starts = r.segments
        assert r.anchor_len == system_end - ANCHOR_SLACK
        assert tools_end < system_end <= starts[0] and starts == sorted(starts) and starts[-1] < r.n


def test_two_agents_run_in_parallel(full):
    carmen = [r.t for r in full if r.agent == "carmen"]
    coder = [r.t for r in full if r.agent == "coder"]
    overlap = min(max(carmen), max(coder)) - max(min(carmen), min(coder))
    assert overlap > 600


def test_tiny_scale_keeps_the_shapes_about_20x_smaller(full, tiny):
    big = np.median([r.anchor_len for r in full if r.kind == "new_session" and not r.agent.startswith(CLIENTS)])
    small = np.median([r.anchor_len for r in tiny if r.kind == "new_session" and not r.agent.startswith(CLIENTS)])
    assert 15 < big / small < 25
    assert {"retry", "regenerate", "edit", "subagent", "scheduled"} <= {r.kind for r in tiny}
