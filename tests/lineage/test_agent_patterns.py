"""Real agent clients' patterns through the simulator: never fewer tokens than stock 0.7.10.

Random agent-shaped traces (turns, aborts with the partial reply kept or dropped, user after
user, edits of the last message, regenerates, sub-agents, aider's moving reminder) run through
the lineage policy (the server's own request flow, ``apcctl.lab.sim.policies.lineage``) at its
default checkpoint budget and through the model of stock 0.7.10's cache with its cache on.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from apcctl.lab.sim.patterns import STEP_KINDS, Step, build
from apcctl.lab.sim.policies.lineage import LineagePolicy
from apcctl.lab.sim.policies.seen import SeenOraclePolicy
from apcctl.lab.sim.policies.stock import make_stock
from apcctl.lab.sim.sizes import load_sizes
from apcctl.lab.sim.trace import Request
from server_patch.lineage import DIVERGENCE, PERIODIC, LineageConfig
from server_patch.lineage.flow import Admission
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

TINY = load_sizes("tiny")


def reuse(requests: list[Request], **config) -> dict[str, list[int]]:
    """Tokens each policy restores per request, in order."""
    policies = {"lineage": LineagePolicy(TINY, config=LineageConfig(**config)), "stock": make_stock(TINY),
                "seen": SeenOraclePolicy()}
    return {name: [p.serve(req).reused for req in requests] for name, p in policies.items()}


def below_stock(requests: list[Request], got: dict[str, list[int]]) -> list[tuple[int, str, int, int]]:
    return [(i, req.kind, mine, theirs) for i, (req, mine, theirs)
            in enumerate(zip(requests, got["lineage"], got["stock"])) if mine < theirs]


def abort_after_a_long_turn() -> list[Request]:
    """Four streamed turns, a ~5.6k-token user turn, then a user message with no reply between."""
    return build([Step("turn", 40, 200)] * 3 + [Step("turn", 5600, 200),
                                                 Step("abort_dropped", 30, 300, cut=50)],
                 tools=1200, system=600)


def aider_turns() -> list[Request]:
    """aider's default mode: a ~450-token reminder after the newest user message only."""
    return build([Step("turn", q, 250) for q in (22, 60, 107, 35, 80, 50, 44, 90)],
                 reminder=450, tools=1500, system=800)


def test_user_after_user_after_a_long_turn_restores_the_long_turns_periodic_point():
    requests = abort_after_a_long_turn()
    got = reuse(requests)
    assert requests[-1].kind == "user_after_user"
    assert got["stock"][-1] == 8192  # stock's interval snapshot inside the long turn
    assert got["lineage"][-1] >= 8192
    assert below_stock(requests, got) == []


def test_aider_restores_the_start_of_the_previous_user_message_every_turn():
    """Each prompt diverges where the reminder sat; the start of the message before it is kept."""
    requests = aider_turns()
    got = reuse(requests)
    for prev, req, mine, best in zip(requests, requests[1:], got["lineage"][1:], got["seen"][1:]):
        last_start = prev.segments[-1]  # the start of the previous prompt's last message
        assert last_start <= mine <= best
        assert best - mine == best - last_start  # what is left is that user message's text
    assert below_stock(requests, got) == []


# Shrunk counterexamples the property once found: an edit that keeps a long user message whole
# and goes on absorbs the turn's entry; thinning dropped that turn's periodic point (2048), which
# stock keeps, and a second edit of the message diverged just past it.
EDIT_AFTER_AN_EXTENDING_EDIT = dict(
    steps=[Step("turn", 3, 5), Step("turn", 1500, 5), Step("edit", 1500, 5, keep=1500),
           Step("edit", 3, 5, keep=951)], seed=0, reminder=0, generation=1, tools=50, system=20, first=1005)
AFTER_MANY_TURNS = dict(
    steps=[Step("turn", 3, 5)] * 7 + [Step("turn", 3, 469), Step("turn", 1500, 5),
                                      Step("edit", 3, 5, keep=1500), Step("edit", 3, 5, keep=1419)],
    seed=0, reminder=0, generation=1, tools=50, system=20, first=3)
# Edits of a 4k-token first message: one restores at a divergence point inside it (2597) where
# stock, cold, prefills through 2048 and snapshots it; the next edit diverges at 2048. The lineage
# must have captured the stride point below the divergence point when it prefilled past it.
EDITS_BELOW_A_DIVERGENCE_POINT = dict(
    steps=[Step("edit", 3, 1, keep=2598), Step("edit", 1500, 1, keep=1101), Step("edit", 3, 1, keep=1101),
           Step("edit", 3, 1, keep=552)], seed=0, reminder=0, generation=1, tools=50, system=1441, first=4096)
# The same after a few turns with aider's reminder (a targeted search found it: stock 2,048, the
# lineage 1,899 before): the last message starts past the first stride point.
EDITS_BELOW_A_DIVERGENCE_POINT_AFTER_TURNS = dict(
    steps=[Step("edit", 1, 1, keep=139), Step("turn", 1, 1), Step("edit", 1, 1), Step("turn", 1, 185),
           Step("turn", 1, 567), Step("edit", 1746, 1, keep=1), Step("edit", 1500, 1, keep=247),
           Step("edit", 1, 1, keep=247), Step("edit", 1, 1, keep=148)],
    seed=0, reminder=450, generation=1, tools=50, system=944, first=139)


def agent_trace(steps, seed, reminder, generation, tools, system, first) -> list[Request]:
    return build(steps, seed=seed, reminder=reminder, generation=generation, tools=tools,
                 system=system, first_question=first)


def test_an_edit_restores_an_earlier_turns_periodic_point_inside_the_message():
    """Stock keeps the first turn's 2048 point; the lineage's thinning must keep it while the
    message it lies in is the newest turn's last message (found by the property below)."""
    requests = agent_trace(**EDIT_AFTER_AN_EXTENDING_EDIT)
    got = reuse(requests)
    assert [r.kind for r in requests[-2:]] == ["edit", "edit"]
    assert got["stock"][-1] == 2048
    assert got["lineage"][-1] >= 2048
    assert below_stock(requests, got) == []


def test_an_edit_restores_the_stride_point_below_a_divergence_point_it_restored_at():
    requests = agent_trace(**EDITS_BELOW_A_DIVERGENCE_POINT)
    got = reuse(requests)
    assert got["stock"] == [0, 0, 0, 0, 2048]  # cold on request 3: it snapshots 2048
    assert got["lineage"][3] == 2597 and got["lineage"][4] == 2048
    assert below_stock(requests, got) == []


def test_the_stride_point_below_a_divergence_point_is_captured_inside_the_last_message_only():
    requests = agent_trace(**EDITS_BELOW_A_DIVERGENCE_POINT)
    policy = LineagePolicy(TINY)
    policy.serve(requests[0])
    flow = Admission.admit(policy.cache, requests[1].tokens)
    plan = flow.plan
    assert plan.length == requests[1].segments[-1] == 1495 and plan.shared == 4094
    inside = flow.cache.plan_captures(requests[1].tokens, plan, segments=requests[1].segments)
    assert {(c.length, c.kind) for c in inside} >= {(4094, DIVERGENCE), (2048, PERIODIC)}
    # Where the last message starts past it (a later message), the divergence point is no edit
    # of the message that holds the stride point: nothing below it.
    later = flow.cache.plan_captures(requests[1].tokens, plan, segments=(*requests[1].segments, 2100))
    assert (2048, PERIODIC) not in {(c.length, c.kind) for c in later}
    assert not any(c.length == 2048 for c in flow.cache.plan_captures(requests[1].tokens, plan))


def test_the_start_of_the_last_message_is_captured_within_the_min_gap():
    requests = aider_turns()
    policy = LineagePolicy(TINY)
    for req in requests:
        policy.serve(req)
    entry = max((e for e in policy.cache.entries() if not e.is_anchor), key=lambda e: e.length)
    last_start = requests[-1].segments[-1]
    assert last_start in {c.length for c in entry.checkpoints}
    assert last_start in entry.turn_points
    assert len([c for c in entry.checkpoints if c.length != entry.prompt_end]) <= 4


LENGTH = st.one_of(st.integers(3, 120), st.integers(1500, 6000))
STEP = st.builds(Step, kind=st.sampled_from(STEP_KINDS), question=LENGTH, reply=st.integers(5, 800),
                 cut=st.integers(1, 400), keep=st.integers(0, 3000), turns=st.integers(1, 3))


TRACES = dict(steps=st.lists(STEP, min_size=2, max_size=16), seed=st.integers(0, 2**16),
              reminder=st.sampled_from([0, 450]), generation=st.sampled_from([1, 3]),
              tools=st.integers(50, 2500), system=st.integers(20, 1500), first=st.integers(3, 3000))


def never_below_stock(steps, seed, reminder, generation, tools, system, first) -> None:
    requests = agent_trace(steps, seed, reminder, generation, tools, system, first)
    got = reuse(requests)
    assert below_stock(requests, got) == []
    assert all(mine <= best for mine, best in zip(got["lineage"], got["seen"]))


@given(**TRACES)
@example(**EDIT_AFTER_AN_EXTENDING_EDIT)
@example(**AFTER_MANY_TURNS)
@example(**EDITS_BELOW_A_DIVERGENCE_POINT)
@example(**EDITS_BELOW_A_DIVERGENCE_POINT_AFTER_TURNS)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_lineage_never_restores_fewer_tokens_than_stock(steps, seed, reminder, generation, tools,
                                                            system, first):
    never_below_stock(steps, seed, reminder, generation, tools, system, first)


def test_the_pattern_builder_renders_each_kind_as_a_client_would():
    requests = build([Step("abort_kept", 5, 50, cut=7), Step("abort_dropped", 6, 50, cut=4),
                      Step("edit", 8, 30, keep=3), Step("regenerate", reply=9),
                      Step("subagent", 5, 20, turns=2), Step("no_reply", 4, 10)], seed=3)
    kinds = [r.kind for r in requests]
    assert kinds == ["new_session", "turn", "user_after_user", "edit", "regenerate", "subagent", "turn",
                     "turn", "user_after_user"]
    first, kept, dropped, edit, regen = requests[:5]
    assert first.reply.shape[0] == 7 and first.reply_verbatim  # the partial reply is re-sent
    assert kept.reply.shape[0] == 4 and not kept.reply_verbatim  # dropped: user after user
    # user after user: the prompt goes on from the end of the last message, not of the prompt
    assert np.array_equal(dropped.tokens[:kept.n - 3], kept.tokens[:-3])
    assert np.array_equal(regen.tokens, edit.tokens)
    sub = requests[5]
    assert sub.conv == "agent/sub0" and not np.array_equal(sub.tokens[:10], first.tokens[:10])  # own tools
    assert requests[7].conv == first.conv and requests[7].n > regen.n  # the parent goes on
