"""Reply reuse: an entry's head moves past the reply its request generated (issue 13 §2).

Policy level over sized handles (``commit_reply``, the protected prompt end, ``rewind``), a
property test against the same cache without reply reuse, the simulator, and the real patched
server on the tiny model: a follow-up that re-renders the reply token for token restores past
it and answers as a cold server does; a dropped stream and a retry land where they should.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from apcctl.lab.sim.policies.lineage import LineagePolicy
from apcctl.lab.sim.sizes import load_sizes
from apcctl.lab.sim.trace import Request
from server_patch.lineage import FINAL, LineageCache, LineageConfig, SizedKV, SizedSnapshot
from server_patch.lineage.flow import Admission
from tests.lineage.test_lineage_policy import Clock
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

KV = 10
SNAP = 1000


def make(**overrides) -> LineageCache:
    return LineageCache(LineageConfig(**overrides), clock=Clock())


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.RandomState(seed).randint(100, 5000, n)]


def serve(cache: LineageCache, prompt: list[int], reply: list[int] | None, *, rewind: bool = False) -> int:
    """One request through the server's own flow; ``reply`` None is reply reuse off. Returns
    the tokens restored. ``rewind``: the server's lone-request loan, which rewinds an entry
    that a prompt restores at its prompt end."""
    flow = Admission.admit(cache, prompt)
    before, rewinds = flow.plan, cache.stats["reply_rewinds"]
    plan = flow.rewind() if rewind else before
    if cache.stats["reply_rewinds"] > rewinds:
        assert plan.length == before.length and plan.checkpoint is None
    flow.restored() if plan.hit else flow.cold()
    captures = {c.length: (c.kind, SizedSnapshot(SNAP)) for c in flow.captures()}
    if reply is None:
        flow.commit(kv=SizedKV(KV, len(prompt) - 1), head=SizedSnapshot(SNAP), captures=captures)
    else:
        flow.commit_reply(reply, kv=SizedKV(KV, len(prompt) + len(reply)), head=SizedSnapshot(SNAP),
                          prompt_head=SizedSnapshot(SNAP), captures=captures)
    return plan.length


# ----------------------------------------------------------------------------- policy

def test_the_head_moves_past_the_reply_and_the_prompt_end_stays():
    cache = make()
    prompt, reply = ids(200, 1), ids(40, 2)
    serve(cache, prompt, reply)
    (entry,) = cache.entries()
    assert entry.length == 240 and entry.tokens.tolist() == prompt + reply
    assert [(c.length, c.kind) for c in entry.checkpoints] == [(199, FINAL)]
    assert entry.prompt_end == 199 and cache.stats["reply_tokens"] == 40

    verbatim = cache.lookup(prompt + reply + ids(10, 3))
    assert (verbatim.kind, verbatim.length) == ("entry", 240)
    edited = cache.lookup(prompt + reply[:25] + ids(10, 4))  # the template rewrote the reply
    assert (edited.kind, edited.length) == (FINAL, 199)
    resend = cache.lookup(prompt)  # a regenerate or a retry of the identical prompt
    assert (resend.kind, resend.length) == (FINAL, 199)


def test_a_next_turn_absorbs_the_reply_entry_and_its_head_becomes_a_reply_end():
    cache = make()
    p1, r1 = ids(100, 5), ids(30, 6)
    serve(cache, p1, r1)
    p2 = p1 + r1 + ids(20, 7)
    assert serve(cache, p2, ids(30, 8)) == 130
    (entry,) = cache.entries()
    assert [(c.length, c.kind, c.reply_end) for c in entry.checkpoints] == \
        [(99, FINAL, False), (130, FINAL, True), (149, FINAL, False)]
    assert entry.prompt_end == 149


def test_thinning_never_drops_the_newest_turns_prompt_end():
    cache = make(max_checkpoints=1)
    prompt = ids(100, 9)
    for turn in range(6):
        reply = ids(20, 100 + turn)
        serve(cache, prompt, reply)
        (entry,) = cache.entries()
        assert entry.prompt_end == len(prompt) - 1
        assert any(c.length == len(prompt) - 1 for c in entry.checkpoints)
        assert sum(c.length != entry.prompt_end and not c.reply_end for c in entry.checkpoints) <= 1
        prompt = prompt + reply + ids(10, 200 + turn)
    # The one other point counted is the previous turn's prompt end: reply ends go first, so
    # the entry holds what it would hold without reply reuse, and on top of it the reply end
    # the newest turn restored at (an edit of its last message restores there).
    (entry,) = cache.entries()
    assert [(c.kind, c.reply_end) for c in entry.checkpoints] == [(FINAL, False), (FINAL, True), (FINAL, False)]
    assert entry.checkpoints[1].length in entry.turn_points


def test_a_capture_gain_is_measured_from_a_point_reply_reuse_off_would_have():
    """A prompt restoring at a reply end (thinned first) still leaves the divergence
    checkpoint that the same cache without reply reuse leaves: the gain counts from 99."""
    cache = make()
    prompt, reply = ids(100, 21), ids(100, 22)
    serve(cache, prompt, reply)
    turn = prompt + reply + ids(50, 23)
    assert serve(cache, turn, ids(20, 24)) == 200
    branch = turn[:230] + ids(30, 25)
    plan = cache.lookup(branch)
    assert (plan.length, plan.checkpoint.reply_end, plan.durable) == (200, True, 99)
    assert [c.length for c in cache.plan_captures(branch, plan)] == [230]
    serve(cache, branch, ids(5, 26))
    assert cache.lookup(turn[:230] + ids(9, 27)).length == 230


def test_rewind_moves_the_head_back_to_the_prompt_end():
    cache = make()
    prompt, reply = ids(120, 11), ids(30, 12)
    serve(cache, prompt, reply)
    (entry,) = cache.entries()
    assert cache.rewind(entry)
    assert entry.length == 119 and entry.kv.length == 119 and entry.prompt_end == 0
    assert entry.checkpoints == [] and entry.dirty
    plan = cache.lookup(prompt + ids(5, 13))
    assert (plan.kind, plan.length) == ("entry", 119)
    assert not cache.rewind(entry)  # nothing past the prompt end any more


def test_reply_reuse_has_an_off_switch():
    assert LineageConfig.from_env({}).reply_reuse is True
    assert LineageConfig.from_env({"APC_LINEAGE_REPLY_REUSE": "0"}).reply_reuse is False
    with pytest.raises(ValueError, match="APC_LINEAGE_REPLY_REUSE"):
        LineageConfig.from_env({"APC_LINEAGE_REPLY_REUSE": "maybe"})


# A conversation step: how the next prompt is built from the previous prompt and its reply.
#   ("verbatim", k, new): prompt + reply + new tokens (the template re-renders the reply)
#   ("rewritten", k, new): prompt + the reply's first k tokens + other tokens + new tokens
#   ("branch", k, new): the previous prompt cut at k + new tokens (an edit or a regenerate)
STEP = st.tuples(st.sampled_from(["verbatim", "rewritten", "branch"]), st.integers(0, 400),
                 st.integers(1, 60), st.integers(0, 80))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.integers(20, 300), steps=st.lists(STEP, min_size=1, max_size=7),
       max_checkpoints=st.integers(0, 4), rewind=st.booleans(), seed=st.integers(0, 10_000))
@example(first=20, steps=[("verbatim", 0, 45, 0), ("rewritten", 0, 3, 20), ("branch", 115, 2, 20),
                          ("branch", 114, 13, 0), ("branch", 124, 1, 20)],
         max_checkpoints=1, rewind=False, seed=0)
def test_a_next_prompt_never_restores_fewer_tokens_than_without_reply_reuse(
        first, steps, max_checkpoints, rewind, seed):
    """Both caches see the same prompts; only one keeps the replies. At every turn the one
    with reply reuse restores at least as many tokens, less what a divergence capture skips by
    design, and past the whole reply whenever the prompt re-renders it verbatim (and goes on
    past it).

    The slack: a branch keeps the reply-reuse cache's older entry whole (its reply runs past
    the branch point), where the cache without replies extends that entry in place and thins
    its older prompt end away. A later branch then restores near that kept prompt end, and the
    divergence point a few tokens on is not captured (``plan_captures`` needs a gain of
    ``divergence_min_gain`` over the durable point), where the cache without replies, restoring
    cold, captures it. Hypothesis found such a case (the ``@example`` above): 112 against 114.
    """
    rng = np.random.RandomState(seed)
    fresh = lambda n: [int(x) for x in rng.randint(100, 5000, n)]  # noqa: E731
    on, off = make(max_checkpoints=max_checkpoints), make(max_checkpoints=max_checkpoints)
    slack = max(1, on.config.divergence_min_gain) - 1  # a divergence closer than this is not captured
    prompt, reply = fresh(first), fresh(int(rng.randint(0, 50)))
    for kind, cut, new, reply_len in steps:
        got_on, got_off = serve(on, prompt, reply, rewind=rewind), serve(off, prompt, None)
        assert got_on >= got_off - slack
        if kind == "verbatim":
            nxt = prompt + reply + fresh(new)
        elif kind == "rewritten":
            keep = min(cut, len(reply))
            nxt = prompt + reply[:keep] + [1] + fresh(new)  # token 1 is never in a reply
        else:
            nxt = prompt[:max(1, min(cut, len(prompt)))] + fresh(new)
        seen = len(prompt) + len(reply)
        plan = on.lookup(nxt)
        if kind == "verbatim" and len(nxt) > seen and seen >= 16:
            assert plan.length == seen
        prompt, reply = nxt, fresh(reply_len)
    assert serve(on, prompt, reply, rewind=rewind) >= serve(off, prompt, None) - slack


def test_the_simulator_restores_past_each_verbatim_reply():
    """``apcctl bench replay``'s lineage does what the server does: three turns that re-send
    each reply restore past it, as the seen oracle does; with reply reuse off, at n - 1."""
    p0, r0 = np.arange(100, 160, dtype=np.int32), np.arange(200, 230, dtype=np.int32)
    p1 = np.concatenate([p0, r0, np.arange(300, 310, dtype=np.int32)])
    r1 = np.arange(400, 420, dtype=np.int32)
    p2 = np.concatenate([p1, r1, np.arange(500, 505, dtype=np.int32)])
    trace = [Request("c", 0, p0, reply=r0, reply_verbatim=True),
             Request("c", 1, p1, reply=r1, reply_verbatim=True),
             Request("c", 2, p2, reply=np.arange(600, 603, dtype=np.int32))]
    on = LineagePolicy(load_sizes("tiny"))
    assert [on.serve(r).reused for r in trace] == [0, 90, 120]
    off = LineagePolicy(load_sizes("tiny"), config=LineageConfig(reply_reuse=False))
    assert [off.serve(r).reused for r in trace] == [0, 59, 99]


# ----------------------------------------------------------------------------- the server's check

def test_a_row_is_trusted_only_if_its_cache_holds_prompt_plus_every_fed_id(model, layout):
    """``replies.validated`` over real caches of the kilobyte model: the ids reported by the
    decode hook, the generator's count and every KV cache's length must agree."""
    from types import SimpleNamespace

    from tests.fake_model import prefill, random_tokens
    from server_patch.copyfree.replies import Reply, validated
    from server_patch.integration.pending import Pending
    from server_patch.copyfree.settings import CopyFreeSettings
    from server_patch.integration.batch_rows import BatchRows
    from server_patch.integration.generator import GeneratorView
    from server_patch.integration.session import SessionBook, SessionState
    from server_patch.integration.timings import TimingBook
    from server_patch.lineage import COLD, LineageCache, LineageConfig, RestorePlan

    prompt, generated = random_tokens(40, seed=3), random_tokens(5, seed=4)
    caches = model.make_cache()
    prefill(model, caches, np.concatenate([prompt, generated]))
    book = SessionBook(TimingBook())

    def tracked(uid: int, tokens: np.ndarray):
        row = book.admit(Pending(tokens, "0", RestorePlan(0, COLD, prompt_len=len(tokens))))
        book.bind(row.key, uid)
        row.reply = Reply(row.pending, prompt_head=None)
        return row

    row = tracked(7, prompt)
    for token in generated:
        book.decoded([7, 8], [int(token), 99])  # uid 8 is not tracked: ignored
    reply, row.reply = row.reply, None
    def batch(counted: int) -> SimpleNamespace:  # the generator's own count of emitted tokens
        return SimpleNamespace(prompt_cache=caches, _num_tokens=[counted], uids=[7])

    assert validated(layout, reply, batch(5), 0).tolist() == generated.tolist()
    assert validated(layout, reply, batch(6), 0) is None
    short = Reply(reply.pending, None, fed=reply.fed[:-1])  # a step the hook did not see
    assert validated(layout, short, batch(4), 0) is None
    assert book.replying() == []
    left = tracked(9, prompt[:-1])
    assert left.move(SessionState.DECODING, "store")
    class Generator:  # the batch generator, held weakly: uid 7 decodes, uid 9 is in no batch
        _generation_batch, _prompt_batch = SimpleNamespace(uids=[7]), None

    generator = Generator()
    view = GeneratorView()
    view.attach(generator)
    runtime = SimpleNamespace(cache=LineageCache(LineageConfig()))
    BatchRows(runtime, CopyFreeSettings.from_env(), view, None, book).sweep()
    assert book.replying() == [] and left.state == SessionState.ENDED  # uid 9 left no batch we saw: forgotten


# ----------------------------------------------------------------------------- real server

# A template that renders an assistant message right after the generation prompt it answered
# and nothing between it and the next message: history re-renders what the model was fed.
VERBATIM_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- elif c is not none -%}"
    "{%- for i in c -%}{{ i.text if i is mapping else i }}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "[gMASK]<sop>{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{ '<|system|>' + text(m.content) }}"
    "{%- elif m.role == 'user' -%}{{ '<|user|>' + text(m.content) }}"
    "{%- elif m.role == 'assistant' -%}{{ '<|assistant|>' + text(m.content) }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)
WORD = " cache"  # one token on the tiny tokenizer; a logit bias makes the model say only it
REPLY_LEN = 12


@pytest.fixture(scope="module")
def verbatim_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with ``VERBATIM_TEMPLATE`` (its own template inserts an empty thinking
    block into history, and its tokenizer does not re-encode random ids as generated)."""
    out = tmp_path_factory.mktemp("verbatim") / "tiny"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").write_text(VERBATIM_TEMPLATE)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = VERBATIM_TEMPLATE
    config_path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def tokenizer(verbatim_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(verbatim_model))


@pytest.fixture(scope="module")
def server(verbatim_model: Path, tmp_path_factory: pytest.TempPathFactory):
    from tests.server_harness import PatchedServer

    with PatchedServer(verbatim_model, env={"TOP_LOGPROBS_K": "5"},
                       log_dir=tmp_path_factory.mktemp("reply-reuse")) as srv:
        yield srv


def _word_id(tokenizer) -> int:
    (word,) = tokenizer.encode(WORD, add_special_tokens=False)
    return word


def _rendered(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _entry(server, length: int) -> dict:
    status, body = server.admin("GET", "/entries?kind=conversation&tier=ram")
    assert status == 200, body
    found = [e for e in body["entries"] if e["length"] == length]
    assert len(found) == 1, (length, body["entries"])
    return found[0]


def _record(server, before: int) -> dict:
    status, body = server.admin("GET", f"/requests?since={before}")
    assert status == 200, body
    assert body["requests"], "no timing record for the request"
    return body["requests"][-1]


def _last_seq(server) -> int:
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    return max((r["seq"] for r in body["requests"]), default=0)


def _said(tokenizer, count: int) -> str:
    return tokenizer.decode([_word_id(tokenizer)] * count)


@pytest.mark.server
def test_a_follow_up_that_re_renders_the_reply_restores_past_it(server, tokenizer):
    from tests.server_harness import assert_same_output, text

    word = _word_id(tokenizer)
    tenant = "reply-verbatim"
    turn1 = [{"role": "user", "content": text(60, 31)}]
    before = _last_seq(server)
    first = server.chat(turn1, tenant=tenant, max_tokens=REPLY_LEN, logit_bias={str(word): 100.0})
    n1 = first["usage"]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] == REPLY_LEN
    # Every generated token was fed (the last one included: 0.7.10 samples one more, never fed).
    entry = _entry(server, n1 + REPLY_LEN)
    assert (n1 - 1, FINAL) in {(c["length"], c["kind"]) for c in entry["checkpoints"]}
    assert _record(server, before)["reply_tokens"] == REPLY_LEN

    turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": text(12, 32)}]
    ids2 = _rendered(tokenizer, turn2)
    assert ids2[: n1 + REPLY_LEN] == _rendered(tokenizer, turn1) + [word] * REPLY_LEN  # the premise
    before = _last_seq(server)
    warm = server.chat(turn2, tenant=tenant, max_tokens=6, logprobs=True, top_logprobs=5)
    record = _record(server, before)
    assert (record["restore_kind"], record["restored_tokens"]) == ("entry", n1 + REPLY_LEN)
    assert warm["usage"]["prompt_tokens"] == len(ids2)
    cold = server.chat(turn2, tenant="reply-verbatim-cold", max_tokens=6, logprobs=True, top_logprobs=5)
    assert_same_output(warm, cold)


@pytest.mark.server
def test_a_dropped_stream_keeps_what_was_fed_and_a_retry_lands_on_the_prompt_end(server, tokenizer):
    from tests.server_harness import assert_same_output, text, wait_for

    word = _word_id(tokenizer)
    tenant = "reply-dropped"
    turn1 = [{"role": "user", "content": text(50, 41)}]
    n1 = len(_rendered(tokenizer, turn1))
    server.stream_and_drop(turn1, tenant=tenant, chunks=3, max_tokens=2000, logit_bias={str(word): 100.0})

    def fed() -> int:
        status, body = server.admin("GET", "/entries?kind=conversation&tier=ram")
        lengths = [e["length"] for e in body["entries"]
                   if any(c["length"] == n1 - 1 and c["kind"] == FINAL for c in e["checkpoints"])]
        return max(lengths, default=0) - n1

    wait_for(lambda: fed() > 0, "the cancelled request's entry", server)
    kept = fed()
    assert 0 < kept < 2000  # cancelled mid-stream: what it was fed, not what it was asked for

    # A resend with the partial reply the server fed restores past it.
    partial = turn1 + [{"role": "assistant", "content": _said(tokenizer, kept)},
                       {"role": "user", "content": text(8, 42)}]
    assert _rendered(tokenizer, partial)[: n1 + kept] == _rendered(tokenizer, turn1) + [word] * kept
    before = _last_seq(server)
    warm = server.chat(partial, tenant=tenant, max_tokens=4, logprobs=True, top_logprobs=5)
    assert _record(server, before)["restored_tokens"] == n1 + kept
    cold = server.chat(partial, tenant="reply-dropped-cold", max_tokens=4, logprobs=True, top_logprobs=5)
    assert_same_output(warm, cold)

    # A retry of the identical prompt after the dropped connection restores at the prompt end.
    before = _last_seq(server)
    retry = server.chat(turn1, tenant=tenant, max_tokens=4, logprobs=True, top_logprobs=5)
    record = _record(server, before)
    assert (record["restore_kind"], record["restored_tokens"]) == (FINAL, n1 - 1)
    assert_same_output(retry, server.chat(turn1, tenant="reply-dropped-cold2", max_tokens=4,
                                          logprobs=True, top_logprobs=5))


@pytest.mark.server
def test_the_switch_off_keeps_the_entry_at_the_prompt_end(verbatim_model, tokenizer, tmp_path):
    """``APC_LINEAGE_REPLY_REUSE=0``: the behaviour before reply reuse, on the same prompts."""
    from tests.server_harness import PatchedServer, text

    word = _word_id(tokenizer)
    turn1 = [{"role": "user", "content": text(60, 51)}]
    with PatchedServer(verbatim_model, env={"APC_LINEAGE_REPLY_REUSE": "0"}, log_dir=tmp_path) as off:
        first = off.chat(turn1, max_tokens=REPLY_LEN, logit_bias={str(word): 100.0})
        n1 = first["usage"]["prompt_tokens"]
        entry = _entry(off, n1 - 1)
        assert all(c["length"] < n1 - 1 for c in entry["checkpoints"])
        turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": text(12, 52)}]
        before = _last_seq(off)
        off.chat(turn2, max_tokens=4)
        record = _record(off, before)
        kept = (record["restore_kind"], record["restored_tokens"], record["reply_tokens"])
        assert kept == ("entry", n1 - 1, 0)
