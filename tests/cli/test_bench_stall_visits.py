"""``bench stall``'s ``short-visits`` without a server: which modes run it, the settings of
``patched-stock-grow``, and how the visits are told apart from the long stream's token times."""

from __future__ import annotations

from apcctl.lab.bench import stall, stall_visits
from apcctl.lab.bench.stall_session import LEAD_TOKENS, REGROW_STEPS, VISIT_SLACK


def test_every_patched_server_but_the_unpaced_one_runs_the_visits() -> None:
    runs = {mode: "short-visits" in stall.of_mode(mode, list(stall.SCENARIOS)) for mode in (*stall.MODES, "patched@HEAD~1")}
    assert runs == {"stock": False, "patched": True, "patched-unpaced": False, "patched-stock-join": True,
                    "patched-stock-grow": True, "patched@HEAD~1": True}
    assert stall.server_env("patched-stock-grow", ["short-visits"], 0) == {"APC_COPYFREE_GROW": "0"}


def test_the_long_stream_crosses_a_regrow_after_the_visits_it_expects() -> None:
    plan = stall.Plan(context=8192, tokens=60, commits=1)
    expected_end = LEAD_TOKENS + plan.visits * (plan.visit_reply + VISIT_SLACK)
    assert plan.long_tokens >= 300 and plan.long_tokens - expected_end > REGROW_STEPS
    assert stall.Plan(context=8192, tokens=900, commits=1).long_tokens == 900  # never shorter than --tokens


def test_a_visit_counts_as_joined_and_left_only_inside_the_long_stream() -> None:
    long = [float(t) for t in range(10, 30)]  # the long stream's tokens at 10..29 s
    visits = [[12.0, 13.0], [14.5, 16.0], [28.5, 31.0], [5.0, 8.0], []]  # inside, inside, outlives it, before it, none
    report = stall_visits.visits_report(long, visits, reply=2)["visits"]
    assert report == {"done": 4, "joined": 3, "left": 2, "long_tokens_after": 0}
    inside = stall_visits.visits_report(long, visits[:2], reply=2)["visits"]
    assert inside == {"done": 2, "joined": 2, "left": 2, "long_tokens_after": 13}  # 17..29 s
