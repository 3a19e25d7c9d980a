"""End to end, real HTTP on the tiny model: the live oracle is the simulator's seen oracle on the
bundled trace (issue 26).

The bundled trace (``apcctl/lab/sim/traces/agents.jsonl``, 1.7M prompt tokens) is far too
large to prefill on a 2-core CPU in a test, so this replays a deterministic slice of it, in time
order: the first ``FIRST_SESSION`` requests of its ``aider`` agent's first session and the first
``SECOND_SESSION`` of its second (3.7k to 4k tokens each, about 8k for the server to prefill).
That slice is representative of what the oracle has to get right: aider's moving reminder makes every turn
diverge *inside* the previous prompt (the oracle is a mid-prompt common prefix, not a whole
earlier prompt), and the second session shares only the system prompt with the first. The
slice's oracles are the whole trace's: what the second session shares with the first is the
system prompt, already in the first session's first request, and the requests of the first
session left out come after those kept, so no kept request's oracle was set by one left out
(the second check below proves it). It was the first 12 aider requests (about 15k tokens to
prefill), then 3 and 2; each session's second request is already a mid-prompt divergence, and
more turns of the same session add size, not cases. Whole-prompt resends and reply reuse are
covered by tests/e2e/test_e2e_oracle.py; on this slice the trace's seen oracle equals
its plain oracle (aider's replies are not re-rendered verbatim: asserted), so the tiny model's
own replies, which differ from the trace's, change nothing.

Each trace token is sent as one tiny-model word (one token each), the prompt as one user message,
so the server's prompt is the chat template's 3 opening tokens, the trace's tokens one for one,
and its 3 closing tokens (checked against each record's ``prompt_tokens``). Two checks per
request: the server's ``oracle`` equals the seen oracle of the same token sequences rounded down
to the block (exact: a hash collision or an off-by-one in the shadow would fail it), and it is
within one block of the bundled trace's own seen oracle shifted by the template's opening (the
slack is the block rounding, and the rare trace token pair that maps to the same word).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from apcctl.lab.sim.policies.oracle import OraclePolicy
from apcctl.lab.sim.policies.seen import SeenOraclePolicy
from apcctl.lab.sim.trace import Request, bundled_trace_path, read_trace
from apcctl.lab.tinymodel.corpus import WORDS
from tests.server_harness import PatchedServer

pytestmark = pytest.mark.server
AGENT = "aider"
FIRST_SESSION, SECOND_SESSION = 2, 2
REQUESTS = FIRST_SESSION + SECOND_SESSION
BLOCK = 16  # APC_LINEAGE_SHADOW_BLOCK_TOKENS's default
OPENING, CLOSING = 3, 3  # the tiny template's [gMASK]<sop><|user|> and <|assistant|><think></think>
# Server-side token stand-ins for the template's own tokens: never a word's index.
TEMPLATE_OPEN = np.arange(-OPENING, 0, dtype=np.int64)
TEMPLATE_CLOSE = np.arange(-OPENING - CLOSING, -OPENING, dtype=np.int64)


def as_words(tokens: np.ndarray) -> np.ndarray:
    """Each trace token as the index of the tiny-model word it is sent as (one token each)."""
    return tokens.astype(np.int64) % len(WORDS)


def served(req: Request) -> Request:
    """``req`` as the server tokenizes it (its reply left out: the tiny model writes its own)."""
    tokens = np.concatenate([TEMPLATE_OPEN, as_words(req.tokens), TEMPLATE_CLOSE])
    return Request(conv=req.conv, t=req.t, tokens=tokens, namespace=req.namespace, index=req.index)


def test_the_live_oracle_is_the_seen_oracle_on_the_bundled_trace(tiny_model_dir: Path, tmp_path: Path) -> None:
    trace = read_trace(bundled_trace_path()).in_time_order()
    seen, plain = SeenOraclePolicy(), OraclePolicy()  # over the whole bundled trace; seen keeps replies
    trace_seen = {req.index: seen.serve(req).reused for req in trace}
    trace_plain = {req.index: plain.serve(req).reused for req in trace}
    agent = [req for req in trace if req.agent == AGENT]
    first, second = list(dict.fromkeys(req.conv for req in agent))[:2]
    picked = ([req for req in agent if req.conv == first][:FIRST_SESSION]
              + [req for req in agent if req.conv == second][:SECOND_SESSION])
    assert [req.t for req in picked] == sorted(req.t for req in picked)  # replayed in time order
    assert len(picked) == REQUESTS and [req.kind for req in picked].count("new_session") == 2
    assert all(trace_seen[req.index] == trace_plain[req.index] for req in picked)  # no reply re-rendered

    records = []
    with PatchedServer(tiny_model_dir, log_dir=tmp_path) as server:
        for req in picked:
            content = " ".join(WORDS[i] for i in as_words(req.tokens))
            server.chat([{"role": "user", "content": content}], max_tokens=1)
            status, body = server.admin("GET", "/requests")
            assert status == 200, body
            records.append(max(body["requests"], key=lambda r: r["seq"]))

    same_traffic = SeenOraclePolicy()
    warm = 0
    for req, record in zip(picked, records):
        assert record["prompt_tokens"] == OPENING + req.n + CLOSING, (req.index, record)
        expected = same_traffic.serve(served(req)).reused // BLOCK * BLOCK
        assert record["oracle"] == expected, (req.index, record["oracle"], expected)
        assert abs(record["oracle"] - (OPENING + trace_seen[req.index])) < BLOCK, (req.index, record, trace_seen)
        lost = sum(record["lost"].values())
        assert lost == max(0, record["oracle"] - record["restored_tokens"]), record
        warm += record["oracle"] > 0
    assert warm == REQUESTS - 1  # every request but the first shares a prefix: the test compares real work
