"""The trace format: delta-encoded token ids, text records, headers, the bundled trace."""

from __future__ import annotations

import io

import numpy as np
import pytest

from apcctl.lab.sim.patterns import CLIENT_AGENTS
from apcctl.lab.sim.prefix import PrefixSet
from apcctl.lab.sim.trace import (Request, bundled_trace_path, encode, parse_lines, read_trace, tokenize_text,
                             write_trace)


def arr(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def test_round_trip_stores_each_turn_as_a_delta():
    reqs = [Request("a", 0.0, arr(1, 2, 3, 4), anchor_len=2, segments=(2, 3)),
            Request("a", 1.0, arr(1, 2, 3, 4, 5, 6), kind="turn"),
            Request("b", 2.0, arr(1, 2, 9), kind="new_session", namespace="x")]
    out = io.StringIO()
    write_trace(out, reqs, {"seed": 1})
    lines = out.getvalue().splitlines()
    assert '"trace"' in lines[0]
    assert '"from":0,"keep":4,"add":[5,6]' in lines[2]
    back = parse_lines(lines)
    assert back.meta["seed"] == 1
    for original, parsed in zip(reqs, back.requests):
        assert np.array_equal(original.tokens, parsed.tokens)
        assert (parsed.conv, parsed.t, parsed.anchor_len, parsed.segments, parsed.kind, parsed.namespace) == \
            (original.conv, original.t, original.anchor_len, original.segments, original.kind, original.namespace)


def test_text_records_use_a_deterministic_whitespace_tokenizer():
    trace = parse_lines(['{"conv": "c", "t": 0, "text": "hello  world\\nhello"}'])
    ids = trace.requests[0].tokens
    assert ids.shape == (3,) and ids[0] == ids[2] != ids[1]
    assert np.array_equal(ids, tokenize_text("hello world hello"))
    assert tokenize_text("hello")[0] == 1000 + 907060870 % 150_000  # crc32, not hash()


def test_malformed_lines_name_the_line():
    with pytest.raises(ValueError, match="line 2"):
        parse_lines(['{"tokens": [1, 2]}', '{"conv": "x"}'])
    with pytest.raises(ValueError, match="keep"):
        parse_lines(['{"tokens": [1, 2]}', '{"from": 0, "keep": 5}'])


def test_prefix_set_keeps_only_maximal_prompts():
    seen = PrefixSet()
    seen.add(arr(1, 2, 3), 0)
    seen.add(arr(1, 2, 3, 4), 1)  # extends 0, which is dropped
    seen.add(arr(1, 2), 2)  # covered by 1
    seen.add(arr(1, 7), 3)
    assert len(seen) == 2
    assert seen.longest(arr(1, 2, 3, 9)) == (3, 1)
    assert seen.longest(arr(5)) == (0, -1)


def test_bundled_trace_is_small_and_full_scale():
    path = bundled_trace_path()
    assert path.stat().st_size < 5_000_000
    trace = read_trace(path)
    assert trace.meta["scale"] == "full" and len(trace.requests) > 100
    assert trace.prompt_tokens > 1_000_000
    assert all(9_000 <= r.anchor_len + 2 <= 12_000 for r in trace.requests
               if r.agent != "coder-sub" and not r.agent.startswith(CLIENT_AGENTS))


def test_the_bundled_trace_is_the_generators_seed_7_trace():
    """``apcctl bench trace-gen agents.jsonl --seed 7 --scale full --minutes 30`` (docs/benchmarks.md):
    every actor, the generation prompts and the reminder blocks included."""
    from apcctl.lab.sim.tracegen import generate

    bundled = read_trace(bundled_trace_path())
    made, meta = generate(seed=7, scale="full", minutes=30)
    assert {k: bundled.meta[k] for k in ("seed", "scale", "minutes")} == {"seed": 7, "scale": "full", "minutes": 30}
    assert [(r.conv, r.kind, r.tokens.tolist(), r.segments, r.gen, r.blocks) for r in bundled.requests] == \
        [(r.conv, r.kind, r.tokens.tolist(), r.segments, r.gen, r.blocks) for r in made]


def test_the_bundled_trace_resumes_with_a_rebuilt_first_message_and_drops_replies_on_retry():
    """Issue 37's two patterns (the resumer actor): a resume parts from the session's previous
    prompt at its first user message's reminder block; a retry that drops the reply parts at
    the previous prompt's generation prompt."""
    from server_patch.lineage.lookup import common_prefix_len

    previous: dict[str, Request] = {}
    resumes, retries = 0, 0
    for req in read_trace(bundled_trace_path()).in_time_order():
        before = previous.get(req.conv)
        previous[req.conv] = req
        if before is None or req.agent != "resumer":
            continue
        shared = common_prefix_len(before.tokens, req.tokens)
        if req.kind == "resume":
            assert before.blocks and shared == before.blocks[0], (req.index, shared, before.blocks)
            resumes += 1
        elif req.kind == "user_after_user":
            assert before.gen and shared == before.n - before.gen, (req.index, shared, before.n, before.gen)
            retries += 1
    assert resumes >= 2 and retries >= 2


def test_replies_round_trip_and_later_prompts_are_stored_as_deltas_into_them():
    reply = arr(7, 8, 9)
    reqs = [Request("a", 0.0, arr(1, 2, 3), reply=reply, reply_verbatim=True),
            Request("a", 1.0, arr(1, 2, 3, 7, 8, 9, 4, 5))]
    lines = list(encode(reqs, None))
    assert '"reply":[7,8,9],"verbatim":true' in lines[0]
    assert '"from":0,"keep":6,"add":[4,5]' in lines[1]  # keep reaches past request 0's prompt
    back = parse_lines(lines).requests
    assert np.array_equal(back[0].reply, reply) and back[0].reply_verbatim
    assert np.array_equal(back[1].tokens, reqs[1].tokens) and back[1].reply is None
    assert np.array_equal(back[0].seen, arr(1, 2, 3, 7, 8, 9)) and back[1].seen is back[1].tokens


def test_a_trace_without_replies_loads_as_before():
    old = parse_lines(['{"tokens": [1, 2, 3]}', '{"from": 0, "add": [4]}'])
    assert old.requests[0].reply is None and not old.requests[0].reply_verbatim
    assert old.requests[1].tokens.tolist() == [1, 2, 3, 4]  # keep defaults to the prompt, not the reply
    with pytest.raises(ValueError, match="keep"):
        parse_lines(['{"tokens": [1, 2], "reply": [3]}', '{"from": 0, "keep": 4}'])


def test_the_bundled_trace_carries_replies_the_next_prompt_repeats():
    requests = read_trace(bundled_trace_path()).requests
    with_reply = [r for r in requests if r.reply is not None]
    assert len(with_reply) > 100
    verbatim = [r for r in with_reply if r.reply_verbatim]
    assert len(verbatim) > 70
    for r in verbatim:
        seen = r.seen
        assert any(o.conv == r.conv and o.n >= seen.shape[0] and np.array_equal(o.tokens[:seen.shape[0]], seen)
                   for o in requests if o.index > r.index)
