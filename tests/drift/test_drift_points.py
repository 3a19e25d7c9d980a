"""The restore points that absorb the two measured client patterns (issue 37), in the policy
the server and the replay share: a retry that drops the reply (mini-swe-agent after a format
error) and a session resumed with its first user message rebuilt (qwen-code ``-c``)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from apcctl.lab.sim.patterns import Step, build
from apcctl.lab.sim.replay import replay_policy
from apcctl.lab.sim.sizes import load_sizes
from server_patch.boundaries import Kind
from server_patch.boundaries.system_points import add_points
from server_patch.drift import DriftDetector, DriftSettings
from server_patch.lineage import COLD, LineageCache, LineageConfig, RestorePlan
from tests.drift.chat import WordTokenizer, render
from tests.lineage.test_agent_patterns import below_stock, reuse


def served(steps: list[Step], **kwargs) -> tuple[list, dict[str, list[int]]]:
    requests = build(steps, seed=3, tools=600, system=400, first_question=500, generation=3, **kwargs)
    sizes = load_sizes("tiny")
    return requests, {name: replay_policy(name, requests, sizes).reused for name in ("lineage-nodrift", "lineage")}


def test_a_retry_that_drops_the_reply_restores_at_the_generation_prompt() -> None:
    requests, reused = served([Step("turn", question=300, reply=200), Step("no_reply", question=40, reply=200)])
    retry, before = requests[-1], requests[-2]
    assert retry.kind == "user_after_user"
    gen_start = before.gen_start
    assert gen_start == before.n - 3
    assert reused["lineage"][-1] == gen_start  # everything the two prompts share
    assert reused["lineage-nodrift"][-1] < gen_start  # the entry at n - 1 is one token past it


def test_a_resume_restores_at_the_rebuilt_block_start() -> None:
    steps = [Step("turn", question=300, reply=200), Step("turn", question=300, reply=200),
             Step("resume", question=40, reply=200)]
    requests, reused = served(steps, first_reminder=60)
    resumed = requests[-1]
    assert resumed.kind == "resume"
    block = requests[0].blocks[0]
    assert reused["lineage"][-1] == block
    assert reused["lineage-nodrift"][-1] < block


def test_drift_points_are_captured_whatever_their_gap_above_where_they_gain_enough_below() -> None:
    cache = LineageCache(LineageConfig())
    gain = cache.config.divergence_min_gain
    tokens = np.arange(1000, 3000, dtype=np.int32)
    plan = RestorePlan(0, COLD, prompt_len=len(tokens))
    plain = {c.length for c in cache.plan_captures(tokens, plan, segments=[1500])}
    with_points = {c.length for c in cache.plan_captures(tokens, plan, segments=[1500], drift_points=[1997, 1990])}
    # 1990 is 3 tokens below the entry's head and far above the segment at 1500: taken. 1997
    # gains 7 tokens over 1990: a retry parting there re-prefills 7 tokens rather than every
    # turn paying a split prefill.
    assert with_points - plain == {1990}
    # A warm turn whose short suffix holds its generation prompt's start (bench ttft's 21-token
    # questions): the point gains less than a divergence point must over the restore point, so
    # the suffix is prefilled in one forward.
    warm = RestorePlan(1980, "entry", prompt_len=len(tokens))
    assert 1997 - 1980 < gain
    assert 1997 not in {c.length for c in cache.plan_captures(tokens, warm, drift_points=[1997])}
    far = RestorePlan(1997 - gain, "entry", prompt_len=len(tokens))
    assert 1997 in {c.length for c in cache.plan_captures(tokens, far, drift_points=[1997])}


def test_points_off_captures_none() -> None:
    detector = DriftDetector(DriftSettings(absorb=False))
    assert detector.points(np.arange(100), "ns", gen_start=97, blocks=[50]) == []
    assert DriftDetector().points(np.arange(100), "ns", gen_start=97, blocks=[50]) == [97, 50]


def test_a_rebuilt_history_point_is_offered_to_later_prompts_sharing_it() -> None:
    tok = WordTokenizer()
    context = "Project context: " + " ".join(f"file{i}.py" for i in range(40))
    reminder = "\n<system-reminder>The current date is 2026-12-05.</system-reminder>"
    detector = DriftDetector()

    def send(first: str, *turns: str) -> tuple[np.ndarray, dict]:
        msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": first}]
        msgs += [{"role": "assistant" if i % 2 == 0 else "user", "content": t} for i, t in enumerate(turns)]
        ids, kinds, gen = render(tok, msgs)
        return ids, detector.observe(ids, "ns", kinds=kinds, gen_start=gen, decode=tok.decode)

    send(context + reminder, "ok", "go")
    ids, found = send(context, "ok", "go", "done", "more")
    assert found["cause"] == "history rebuilt on resume"
    later, _ = send(context + reminder + " new task")
    assert found["position"] in detector.points(later, "ns")
    assert detector.points(later, "other") == []


def test_the_first_user_messages_section_starts_are_blocks() -> None:
    system = {"role": "system", "content": "You are an agent. " * 10}
    user = {"role": "user", "content": "Context:\n" + "a line of project context\n" * 20
            + "<system-reminder>\nThe current date is 2026-12-05.\n</system-reminder>\nFix the bug."}
    full = f"<s>{system['content']}</s><u>{user['content']}</u>"
    offsets: dict[int, str] = {}
    add_points([system, user], full, offsets, keep=2, anchor_offsets=[])
    blocks = [o for o, k in offsets.items() if k == Kind.BLOCK]
    assert blocks == [full.index("<system-reminder>")]
    assert not any(k in (Kind.LINE, Kind.SECTION) for o, k in offsets.items() if o > full.index("<u>"))


RESUME_STEP = st.builds(Step, kind=st.sampled_from(["turn", "resume", "no_reply", "edit", "regenerate"]),
                        question=st.integers(3, 400), reply=st.integers(5, 400), keep=st.integers(0, 400))


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(RESUME_STEP, min_size=2, max_size=10), seed=st.integers(0, 2**16),
       generation=st.sampled_from([1, 3]), first=st.integers(3, 3000), first_reminder=st.sampled_from([0, 60]))
def test_resumes_and_retries_never_restore_fewer_tokens_than_stock(steps, seed, generation, first, first_reminder):
    requests = build(steps, seed=seed, generation=generation, tools=300, system=200, first_question=first,
                     first_reminder=first_reminder)
    got = reuse(requests)
    assert below_stock(requests, got) == []
