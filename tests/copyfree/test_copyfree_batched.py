"""Copy-free admission and commit through the real batched path (mlx-vlm's ResponseGenerator,
in-process with the overlay, the copy counter on, tiny model).

A subprocess per configuration: the overlay must be installed before mlx-vlm is imported,
and the counter wraps mlx-vlm's cache classes for the whole process. The baselines run only
what they are compared on: stock merge (APC_COPYFREE=0) the lone turns (A), cold A, E and F. It prints one JSON
object; the assertions are here. No wall-clock thresholds: copies are counted in bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KV_OPS = ("clone", "reserve", "merge", "regrow", "cow", "extract", "reply_append")

SCRIPT = textwrap.dedent(r"""
    import json, logging, sys, threading, time
    from queue import Queue
    from server_patch.overlay import install
    install()
    from server_patch.copyfree import counter, pool
    from server_patch.observe import ledger
    counter.install()
    import mlx.core as mx
    import numpy as np
    from mlx_vlm import apc as _apc
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.server.generation import GenerationArguments, GenerationContext, ResponseGenerator
    from server_patch.integration.parts import of_server
    current = lambda: of_server().runtimes.current  # the server's open lineage runtime

    commits, loans = [], []

    class Grab(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("apc_copyfree commit"):
                commits.append(dict(kv.split("=", 1) for kv in message.split()[2:]))
            if message.startswith("apc_copyfree loan"):
                loans.append(message.split(": ", 1)[1])

    logging.getLogger("server_patch.lineage").addHandler(Grab())
    logging.getLogger("server_patch.lineage").setLevel(logging.INFO)

    class GatedQueue(Queue):
        # Holds puts until `expect` requests are queued, then releases them at once, so the
        # generator admits them into one prompt batch.
        expect, held = 0, []

        # Called in the generator thread with each token it hands a request (and that request's
        # token queue) before the request sees it, while set: what C waits on (see `JoinWatch`).
        on_token = None

        def put(self, item, block=True, timeout=None):
            if self.on_token is not None and item is not None:
                tokens, seen, plain = item.rqueue, self.on_token, item.rqueue.put

                def watched(token, *a, **k):
                    seen(tokens, token)
                    return plain(token, *a, **k)

                tokens.put = watched
            if self.expect and item is not None:
                self.held.append(item)
                if len(self.held) < self.expect:
                    return
                with self.mutex:
                    for held in self.held:
                        self._put(held)
                    self.unfinished_tasks += len(self.held)
                    self.not_empty.notify_all()
                self.expect, self.held = 0, []
                return
            if self.hold_after_first_token and item is not None:
                self.hold_after_first_token = False
                tokens = item.rqueue
                plain_put = tokens.put

                def first_token_holds(token, *a, **k):
                    # In the generator thread, with this request's first token (its context comes
                    # first, at admission): from now on the batch waits at its next poll until
                    # another request is queued, so this one is still decoding when that one
                    # joins, however slow the machine.
                    if not isinstance(token, GenerationContext):
                        tokens.put = plain_put
                        self.hold = True
                    return plain_put(token, *a, **k)

                tokens.put = first_token_holds
            super().put(item, block, timeout)

        hold_after_first_token, hold = False, False

        def get_nowait(self):
            if self.on_token is not None:  # the generator's poll between two batch steps
                self.on_token.poll()
            if self.hold:
                self.hold = False
                return self.get(timeout=300)
            return super().get_nowait()

    class JoinWatch:
        # C's precondition and its copy window, read in the generator thread, not from how fast
        # the clients read: at the generator's first poll after the joiner's last token (its row
        # has left the batch, the next step has not run), the generator waits for `resume`, and
        # the long request (queued first) had not had its last token then: it still decoded.
        # The copies counted while it waits are the joiner's life and nothing after it, however
        # slow the machine.
        def __init__(self):
            self.queues, self.joiner_ended, self.long_ended = [], False, False
            self.paused, self.long_decoding = False, None
            self.resume = threading.Event()

        def __call__(self, tokens, token):
            if isinstance(token, GenerationContext):
                return
            if tokens not in self.queues:
                self.queues.append(tokens)
            final = bool(getattr(token, "finish_reason", None))
            if tokens is not self.queues[0]:
                self.joiner_ended = self.joiner_ended or final
            elif final:
                self.long_ended = True

        def poll(self):
            if self.joiner_ended and not self.paused:
                self.paused, self.long_decoding = True, not self.long_ended
                self.resume.wait(300)

    def waited(read, timeout=120):
        # polls until `read()` is truthy (a record or log line written just after the last token)
        deadline = time.monotonic() + timeout
        while not (found := read()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    model_dir, mode = sys.argv[1], sys.argv[2]
    # Tokens of a request kept decoding while another joins its batch (C, D): the joiner lives 6
    # to 15 of its steps; C's `long_decoding` and D's `while_decoding` check it still decoded.
    LONG = 60
    logs_commits = mode == "copyfree"  # with APC_COPYFREE=0 no "apc_copyfree commit" line is logged
    rg = ResponseGenerator(model_path=model_dir,
                           apc_manager=None if mode == "cold" else _apc.from_env(model_namespace="t"))
    model, processor, config = rg.wait_until_ready()
    rg.requests = GatedQueue()
    eos = sorted(int(t) for t in rg.stop_tokens)

    def text(n, seed):
        rng = np.random.RandomState(seed)
        words = "apple banana cherry delta echo fox golf hotel india juliet kilo lima".split()
        return " ".join(words[i] + str(int(j)) for i, j in zip(rng.randint(0, 12, n), rng.randint(0, 99, n)))

    def ask(messages, max_tokens=6, on_first=None, no_eos=False):
        prompt = apply_chat_template(processor, config, messages)
        args = GenerationArguments(max_tokens=max_tokens, temperature=0.0,
                                   logit_bias={t: -1000.0 for t in eos} if no_eos else None)
        ctx, it = rg.generate(prompt=prompt, args=args)
        out = ""
        for tok in it:
            if on_first is not None:
                on_first.set()
                on_first = None
            out += tok.text
            if tok.finish_reason:
                break
        return {"prompt": ctx.prompt_tokens, "text": out}

    def record_of(prompt_tokens):
        for r in reversed(list(current().timings.all())):
            if r.prompt_tokens == prompt_tokens:
                return {"kind": r.restore_kind, "restored": r.restored_tokens}
        return None

    def kv_of(prompt_tokens):
        for r in reversed(list(current().timings.all())):
            if r.prompt_tokens == prompt_tokens:
                return r.kv_admission
        return None

    def mark():  # the records so far (none before the first request opens the runtime)
        return len(current().timings.all()) if mode != "cold" and current() is not None else 0

    def settled(since, count):
        # Until the `count` requests whose records follow `since` have left their batches (each
        # record says `ended`): by then their rows' end commits and copies are counted. Cold
        # commits nothing.
        def ended():
            records = list(current().timings.all())[since:]
            return len(records) >= count and all(r.ended for r in records)

        assert mode == "cold" or waited(ended), "a request's row did not end"

    def grown(messages, turns, seed, last_words=12):
        # `turns` answered turns, then a new user message of `last_words` words
        for turn in range(turns):
            answer = ask(messages)
            words = last_words if turn == turns - 1 else 12
            messages = messages + [{"role": "assistant", "content": answer["text"] or "ok"},
                                   {"role": "user", "content": text(words, seed + turn)}]
        return messages

    cancel_next = []
    if mode != "cold":
        from server_patch.integration.coordinator import LineageCoordinator
        _bind = LineageCoordinator.bind_rows

        def bind_then_cancel(self, uids, metas):
            # a client that goes away right after admission: the cancellation lands between
            # two prefill chunks (PREFILL_STEP_SIZE is small in these runs)
            if cancel_next and uids:
                cancel_next.clear()
                rg._cancel(uids[0])
            return _bind(self, uids, metas)

        LineageCoordinator.bind_rows = bind_then_cancel

    def kv_per_token():
        entries = [e for e in current().cache.entries() if e.length]
        return max(e.kv.nbytes / e.length for e in entries)

    result = {}

    def done():
        result["pool"] = pool.stats()
        print(json.dumps(result))
        rg.stop_and_join()
        sys.exit(0)

    # A: one conversation, every request alone in its batch.
    convo = [{"role": "system", "content": text(60, 1)}, {"role": "user", "content": text(150, 2)}]
    turns, held = [], None
    for turn in range(4):
        before, since = ledger.snapshot(), mark()
        answer = ask(convo)
        settled(since, 1)
        answer["copies"] = ledger.delta(ledger.snapshot(), before)
        answer["messages"] = list(convo)
        if mode != "cold":
            answer["record"] = record_of(answer["prompt"])
            answer["kv"] = kv_of(answer["prompt"])
            entry = max(current().cache.entries(), key=lambda e: e.length)
            if turn == 0:
                held = (entry.kv, entry.head, [np.array(a) for a in entry.kv.prefix(entry.length).arrays()]
                        + [np.array(a) for a in entry.head.arrays()])
            if turn == 1:  # the entry the third turn is lent: its rows, to compare afterwards
                lent_rows = (entry.tokens.copy(), [np.array(a) for a in entry.kv.prefix(entry.length).arrays()])
        turns.append(answer)
        convo = convo + [{"role": "assistant", "content": answer["text"] or "ok"},
                         {"role": "user", "content": text(12, 10 + turn)}]
    result["alone"] = turns
    result["commits_alone"] = list(commits)
    if mode == "stock_merge":  # the A/B baseline: its lone turns' copies and the pool's clears
        result["kv_per_token"] = kv_per_token()
        done()

    # E: a lent request is decoding when the same prompt comes again (a parallel restore):
    # the loan ends early, the borrower copies on its next write, both answers stay right.
    shared = grown([{"role": "system", "content": text(40, 70)}, {"role": "user", "content": text(120, 71)}],
                   2, 72)
    loans.clear()
    since = mark()
    decoding, long_out = threading.Event(), {}
    t = threading.Thread(target=lambda: long_out.update(
        ask(shared, max_tokens=30, on_first=decoding, no_eos=True)))
    t.start()
    decoding.wait(120)
    # a branch: the same conversation up to the lent entry, another last question
    short = ask(shared[:-1] + [{"role": "user", "content": text(12, 99)}], max_tokens=6, no_eos=True)
    t.join(300)
    settled(since, 2)
    result["shared"] = {"long": long_out["text"], "short": short["text"], "loans": list(loans)}

    # F: a lent request is cancelled mid-prefill; its entry comes back whole and serves the
    # resend, whose answer equals a cold prefill's.
    cancelled = grown([{"role": "system", "content": text(40, 80)}, {"role": "user", "content": text(120, 81)}],
                      2, 82, last_words=80)
    loans.clear()
    first = None
    if mode != "cold":
        cancel_next.append(True)
        first = ask(cancelled)
    resend = ask(cancelled)
    result["cancel"] = {"first": first, "resend": resend["text"], "loans": list(loans),
                        "kv": kv_of(resend["prompt"]) if mode != "cold" else None,
                        "record": record_of(resend["prompt"]) if mode != "cold" else None}

    if mode == "cold":
        done()
    kv, head, arrays = held
    now = kv.prefix(kv.length).arrays() + head.arrays()
    result["first_entry_unchanged"] = len(now) == len(arrays) and all(
        np.array_equal(a, np.array(b)) for a, b in zip(arrays, now))
    result["first_entry_absorbed"] = all(e.kv is not kv for e in current().cache.entries())
    tokens, rows_before = lent_rows
    length = len(tokens)
    latest = max((e for e in current().cache.entries()
                  if e.length > length and np.array_equal(e.tokens[:length], tokens)), key=lambda e: e.length)
    now = latest.kv.prefix(length).arrays()
    result["lent_rows_unchanged"] = len(now) == len(rows_before) and all(
        np.array_equal(a, np.array(b)) for a, b in zip(rows_before, now))
    result["kv_per_token"] = kv_per_token()

    # B: two warm turns admitted together (one prompt batch of two rows).
    pair = [[{"role": "system", "content": text(50, 20 + i)}, {"role": "user", "content": text(140, 30 + i)}]
            for i in range(2)]
    first = [ask(m) for m in pair]
    pair = [m + [{"role": "assistant", "content": a["text"] or "ok"}, {"role": "user", "content": text(12, 40 + i)}]
            for i, (m, a) in enumerate(zip(pair, first))]
    commits.clear()
    rg.requests.expect = 2
    before, since = ledger.snapshot(), mark()
    out = [None, None]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, ask(pair[i]))) for i in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    settled(since, 2)
    result["pair"] = {"copies": ledger.delta(ledger.snapshot(), before),
                      "records": [record_of(a["prompt"]) for a in out], "commits": list(commits),
                      "next": [record_of(ask(m + [{"role": "assistant", "content": a["text"] or "ok"},
                                                  {"role": "user", "content": "go on"}])["prompt"])
                               for m, a in zip(pair, out)],
                      "prompts": [a["prompt"] for a in out]}

    # C: a warm turn joins a batch that is decoding another conversation. Held at its first
    # token until the joiner is queued, the long request decodes one token per batch step: 6 to 15
    # of them while the joiner (a short suffix, 6 tokens) lives; LONG leaves it decoding well
    # after the joiner has left, and "long_decoding" checks that it did.
    long_convo = [{"role": "system", "content": text(40, 50)}, {"role": "user", "content": text(100, 51)}]
    decoding = threading.Event()
    commits.clear()
    watch = rg.requests.on_token = JoinWatch()
    rg.requests.hold_after_first_token = True
    long_thread = threading.Thread(target=lambda: result.__setitem__(
        "long", ask(long_convo, max_tokens=LONG, on_first=decoding, no_eos=True)))
    long_thread.start()
    decoding.wait(120)
    before = ledger.snapshot()
    joined = ask(convo)
    waited(lambda: watch.paused)  # the generator waits at its poll after the joiner's last token
    joined["long_decoding"] = watch.long_decoding  # the precondition LONG is sized for
    joined["record"] = waited(lambda: record_of(joined["prompt"]))
    joined["copies"] = ledger.delta(ledger.snapshot(), before)
    rg.requests.on_token = None
    watch.resume.set()
    long_thread.join(300)
    if logs_commits:
        waited(lambda: len(commits) >= 2)
    joined["commits"] = list(commits)
    follow = long_convo + [{"role": "assistant", "content": result["long"]["text"]}, {"role": "user", "content": "ok"}]
    joined["long_next"] = record_of(ask(follow)["prompt"])
    joined["long_prompt"] = result.pop("long")["prompt"]
    result["join"] = joined

    # D: a resend while the first copy of the request is still decoding.
    resend = [{"role": "system", "content": text(40, 60)}, {"role": "user", "content": text(120, 61)}]
    decoding = threading.Event()
    commits.clear()
    rg.requests.hold_after_first_token = True
    t = threading.Thread(target=lambda: ask(resend, max_tokens=LONG, on_first=decoding, no_eos=True))
    t.start()
    decoding.wait(120)
    again = ask(resend, max_tokens=4)
    again_while_decoding = t.is_alive()
    t.join(300)
    if logs_commits:  # the deferred entry's commit at the resend's lookup (the decoding copy's
        # own end then keeps its reply past an entry already stored: no second commit line)
        waited(lambda: any((c["mode"], c["reason"]) == ("copy", "lookup") for c in commits))
    result["resend"] = {"prompt": again["prompt"], "record": waited(lambda: record_of(again["prompt"])),
                        "commits": list(commits), "while_decoding": again_while_decoding}

    done()
""")


def run(model_dir: Path, tmp_path: Path, mode: str, **env: str) -> dict:
    full_env = dict(os.environ, APC_ENABLED="1", APC_DISK_ENABLED="0", APC_LINEAGE_DISK="0", PREFILL_STEP_SIZE="128",
                    HF_HUB_OFFLINE="1", APC_STATE_DIR=str(tmp_path / f"state-{mode}"),
                    PYTHONPATH=str(REPO), **env)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), mode], env=full_env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def kv_copied(copies: dict[str, int]) -> int:
    return sum(v for k, v in copies.items() if k.endswith(".kv") and k.split(".")[0] in KV_OPS)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("copyfree")
    return {
        "copyfree": run(tiny_model_dir, tmp, "copyfree"),
        "stock_merge": run(tiny_model_dir, tmp, "stock_merge", APC_COPYFREE="0", APC_POOL_CLEAR="1"),
        "cold": run(tiny_model_dir, tmp, "cold"),
    }


def test_a_lone_warm_turn_copies_the_kv_once_then_not_at_all(runs):
    result = runs["copyfree"]
    per_token = result["kv_per_token"]
    for turn in result["alone"][1:]:
        assert turn["record"]["kind"] == "entry", turn["record"]
        one_copy = per_token * turn["record"]["restored"]
        copied = kv_copied(turn["copies"])
        assert copied <= 1.1 * one_copy, (copied / one_copy, turn["copies"])
        for op in ("cow", "extract", "clone", "reserve"):
            assert turn["copies"].get(f"{op}.kv", 0) == 0, turn["copies"]
    # The cold turn's buffer has no room to spare: the first warm turn copies it once, into
    # a buffer with room for the next turns, which are then lent it and append in place.
    first, *later = result["alone"][1:]
    assert first["kv"] == "copied"
    assert first["copies"].get("merge.kv", 0) >= 0.99 * per_token * first["record"]["restored"]
    assert [t["kv"] for t in later] == ["lent"] * len(later)
    # Left: the pooled index windows, which mlx-vlm's pooling cache merges and regrows itself
    # (~5 % of the KV on this tiny model, whose pooling ratio is small; < 0.1 % on the bench
    # preset). No latent or index row is copied.
    for turn in later:
        assert set(turn["copies"]) <= {"merge.kv", "regrow.kv", "merge.state"}, turn["copies"]
        assert kv_copied(turn["copies"]) <= 0.06 * per_token * turn["record"]["restored"], turn["copies"]
    # Every entry was committed by adopting the request's own buffer when it ended.
    assert [c["mode"] for c in result["commits_alone"]] == ["adopt"] * 4
    assert {c["reason"] for c in result["commits_alone"]} == {"end"}


def test_without_copyfree_the_same_turns_copy_more(runs):
    """The A/B baseline (APC_COPYFREE=0): merge, regrow and a row extraction per warm turn."""
    result = runs["stock_merge"]
    per_token = result["kv_per_token"]
    for turn in result["alone"][1:]:
        one_copy = per_token * turn["record"]["restored"]
        assert kv_copied(turn["copies"]) >= 2.5 * one_copy, turn["copies"]
    assert result["pool"]["cleared"].get("prefill_chunk", 0) > 0  # APC_POOL_CLEAR=1 is stock
    assert runs["copyfree"]["pool"]["cleared"] == {}
    assert runs["copyfree"]["pool"]["skipped"]["prefill_chunk"] > 0
    assert runs["copyfree"]["pool"]["skipped"]["prompt_batch"] > 0


def test_stored_entry_is_unchanged_after_a_warm_turn_extends_it(runs):
    result = runs["copyfree"]
    assert result["first_entry_absorbed"]  # later turns extended (and absorbed) it
    assert result["first_entry_unchanged"]  # yet every array it held is bit-identical
    # The entry lent to the next turn: its rows, extended in place, are bit-identical too.
    assert result["lent_rows_unchanged"]


def test_a_parallel_restore_ends_the_loan_and_both_answers_are_right(runs):
    shared = runs["copyfree"]["shared"]
    assert "shared" in shared["loans"], shared["loans"]
    assert shared["long"] == runs["cold"]["shared"]["long"]
    assert shared["short"] == runs["cold"]["shared"]["short"]


def test_a_cancelled_borrower_gives_the_rows_back(runs):
    cancel = runs["copyfree"]["cancel"]
    assert cancel["loans"][0] == "removed", cancel["loans"]
    assert cancel["first"]["text"] == ""  # it really was cancelled before its first token
    # The resend restores the same entry, is lent it again, and answers as a cold prefill does.
    assert cancel["record"]["kind"] == "entry" and cancel["kv"] == "lent"
    assert cancel["resend"] == runs["cold"]["cancel"]["resend"]


def test_greedy_output_warm_equals_cold(runs):
    cold = [t["text"] for t in runs["cold"]["alone"]]
    assert [t["text"] for t in runs["copyfree"]["alone"]] == cold
    assert [t["text"] for t in runs["stock_merge"]["alone"]] == cold
    assert [t["prompt"] for t in runs["copyfree"]["alone"]] == [t["prompt"] for t in runs["cold"]["alone"]]


def test_rows_sharing_a_batch_copy_once_and_append_only_their_new_rows(runs):
    pair = runs["copyfree"]["pair"]
    per_token = runs["copyfree"]["kv_per_token"]
    assert [r["kind"] for r in pair["records"]] == ["entry", "entry"], pair["records"]
    # Two rows share the prompt batch: each restored at its entry's head (an adopted buffer
    # with room), so when it ends, past its reply (reply reuse; at most 6 generated tokens
    # here), only its prompt suffix and reply are written into that entry's buffer; no row is
    # copied out. The merge copies the restored rows (fewer than the prompt).
    commits = pair["commits"]
    assert sorted((c["mode"], c["reason"]) for c in commits) == [("append", "end")] * 2, commits
    assert sorted(int(c["tokens"]) - int(c["reply"]) for c in commits) == sorted(pair["prompts"])
    restored = sorted(r["restored"] for r in pair["records"])
    assert sorted(int(c["tokens"]) - int(c["appended_rows"]) for c in commits) == restored, commits
    one_copy = per_token * sum(n + 6 for n in pair["prompts"])
    copied = kv_copied(pair["copies"])
    assert copied <= 1.1 * one_copy, (copied / one_copy, pair["copies"])
    appended = sum(int(c["appended_rows"]) for c in commits)
    assert 0 < pair["copies"].get("reply_append.kv", 0) <= per_token * appended, pair["copies"]
    assert pair["copies"].get("extract.kv", 0) == 0, pair["copies"]
    # And both entries serve their next turns, at least at the prompt end.
    for record, n in zip(pair["next"], pair["prompts"]):
        assert record["kind"] == "entry" and record["restored"] >= n - 1, (record, n)


def test_a_row_joining_a_decoding_batch_is_adopted_not_copied(runs):
    joined = runs["copyfree"]["join"]
    assert joined["long_decoding"]  # the other request still decoded when this one answered
    assert joined["record"]["kind"] == "entry"
    assert {(c["mode"], c["reason"]) for c in joined["commits"]} == {("adopt", "join")}, joined["commits"]
    assert len(joined["commits"]) == 2  # the decoding request's entry and the joining one's
    for op in ("cow", "clone", "reserve"):
        assert joined["copies"].get(f"{op}.kv", 0) == 0, joined["copies"]
    # Reply reuse: the joined row leaves a two-row batch, so its entry moves past its reply by
    # writing its reply's rows into the buffer its join adopted, or (that entry queued for
    # writing meanwhile) by one copy of its row (prompt + at most 6 generated tokens); nothing
    # else is extracted. tests/copyfree/test_reply_append.py pins the bytes of the first case.
    fed_rows = joined["prompt"] + 6
    assert joined["copies"].get("extract.kv", 0) <= runs["copyfree"]["kv_per_token"] * fed_rows
    # No disk tier here, so nothing queues the entry: its reply's rows are appended (at most the
    # last prompt token and 6 generated ones), and no row is copied out.
    assert joined["copies"].get("extract.kv", 0) == 0, joined["copies"]
    assert 0 < joined["copies"].get("reply_append.kv", 0) <= runs["copyfree"]["kv_per_token"] * 7, joined["copies"]
    assert joined["long_next"]["kind"] == "entry"
    assert joined["long_next"]["restored"] >= joined["long_prompt"] - 1


def test_a_resend_during_decode_restores_the_deferred_entry(runs):
    resend = runs["copyfree"]["resend"]
    assert resend["while_decoding"]  # its first copy still decoded when the resend answered
    assert resend["record"] == {"kind": "entry", "restored": resend["prompt"] - 1}
    assert ("copy", "lookup") in {(c["mode"], c["reason"]) for c in resend["commits"]}
