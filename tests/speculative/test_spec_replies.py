"""Reply reuse and copy-free admission under speculation, on a real server with the tiny model's
MTP drafter: a conversation that re-sends its replies restores past each reply, prefills no more
than the same conversation without a drafter, and every answer equals a cold drafter server's
and the no-drafter server's.

The conversation is test_e2e_reply_reuse's (the tiny template re-renders a reply verbatim), sent
without logprobs (a drafter server refuses them). Restored tokens are read from each request's
``/admin/requests`` record, with the reply the request stored (``reply_tokens``) and how its KV
reached the batch (``admission``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e import test_e2e_reply_reuse as reuse
from tests.e2e.test_e2e_reply_reuse import converse, tokenizer  # noqa: F401 (the fixture)
from tests.server_harness import PatchedServer, all_running, cached_tokens, text, wait_for
from tests.speculative.test_spec_server import PARAMS, _cold, _drafter_args, acceptance, assert_same_tokens


@pytest.fixture(scope="module")
def servers(spec_model_dir: Path, spec_drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("spec-replies")
    started = {
        "draft": PatchedServer(spec_model_dir, log_dir=root / "draft", args=_drafter_args(spec_drafter_dir)),
        "plain": PatchedServer(spec_model_dir, log_dir=root / "plain"),
    }
    with all_running(started):
        yield started


def _records(server: PatchedServer, since: int) -> list[dict[str, Any]]:
    status, body = server.admin("GET", f"/requests?since={since}")
    assert status == 200, body
    return sorted(body["requests"], key=lambda record: record["seq"])


def _last_seq(server: PatchedServer) -> int:
    status, body = server.admin("GET", "/requests")
    assert status == 200, body
    return max((record["seq"] for record in body["requests"]), default=0)


def _conversation(server: PatchedServer, tokenizer: Any, tenant: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """The conversation's turns and their request records, oldest first."""
    since = _last_seq(server)
    turns = converse(server, tokenizer, tenant)
    records = _records(server, since)
    assert len(records) == len(turns), records
    return turns, records


@pytest.mark.server
def test_replies_under_speculation_are_reused_and_answer_as_cold_and_without(
        servers: dict[str, PatchedServer], tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(reuse, "PARAMS", PARAMS)  # test_spec_server's: no logprobs, 24 tokens
    monkeypatch.setattr(reuse, "MAX_TOKENS", PARAMS["max_tokens"])
    draft, plain = servers["draft"], servers["plain"]
    spec, spec_records = _conversation(draft, tokenizer, "spec-replies")
    without, without_records = _conversation(plain, tokenizer, "plain-replies")
    assert [t.reply for t in spec] == [t.reply for t in without]  # the same conversation
    assert sum(acceptance(t.answer)[2] for t in spec) > 0  # accepted drafts extended the entries
    summary = [[(r["prompt_tokens"], r["restored_tokens"], r["reply_tokens"], r["kv_admission"]) for r in records]
               for records in (spec_records, without_records)]
    # Copy-free admission as without a drafter: each warm turn is lent its entry's buffer.
    admissions = [[r["kv_admission"] for r in records[1:]] for records in (spec_records, without_records)]
    assert admissions[0] == admissions[1] and "lent" in admissions[1], summary
    for k in range(1, len(spec)):
        previous, record, same = spec[k - 1], spec_records[k], without_records[k]
        fed = spec_records[k - 1]["reply_tokens"]  # the reply ids its row's cache verified
        # Every emitted id but the last is verified into the cache (the target's own last token
        # is emitted, never fed); the entry's head is prompt + those, and the next turn
        # restores there: past the reply, at most the one unfed token short of a plain server
        # (whose pipelined step feeds its last id too). docs/models.md, "Reply reuse".
        assert 0 <= int(previous.answer["usage"]["completion_tokens"]) - fed <= 1, summary
        assert record["restored_tokens"] == cached_tokens(spec[k].answer) == len(previous.prompt) + fed, summary
        assert record["restored_tokens"] >= same["restored_tokens"] - 1, summary
    for k, turn in enumerate(spec):
        assert_same_tokens(turn.answer, _cold(draft, turn.messages))
        assert_same_tokens(turn.answer, without[k].answer)


@pytest.mark.server
def test_rows_speculating_in_one_batch_each_keep_their_own_reply(
        servers: dict[str, PatchedServer], tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Two second turns queued together share one speculative batch (its cache rows follow its
    rounds, not its uids: the rows' replies are read back by the rounds' row order); each
    third turn restores past its own second reply and answers as cold and as without a drafter.
    They queue behind a long stream: a decoding speculative batch admits nothing, so both wait
    and are admitted into one prompt batch when it ends. The stream ends as soon as the server has
    taken both from its queue (its client goes away, the server cancels the row)."""
    import threading

    from tests.integration.test_pacing import Stream

    monkeypatch.setattr(reuse, "PARAMS", PARAMS)
    monkeypatch.setattr(reuse, "MAX_TOKENS", PARAMS["max_tokens"])
    draft, plain = servers["draft"], servers["plain"]
    tenants = ("pair-a", "pair-b")
    firsts = [reuse.ask(draft, tokenizer, [{"role": "system", "content": text(50 + 9 * k, 501 + k)},
                                           {"role": "user", "content": text(14, 511 + k)}], tenant)
              for k, tenant in enumerate(tenants)]
    shared_before = draft.log_text().count("apc_lineage reply kept")
    seconds: dict[str, Any] = {}
    errors: list[BaseException] = []

    def send(tenant: str, first: Any, k: int) -> None:
        try:
            seconds[tenant] = reuse.ask(draft, tokenizer, reuse.follow_up(first, text(12, 521 + k)), tenant)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    blocker = Stream(draft, max_tokens=300, seed=541)  # stopped once both are queued: its length bounds a hang
    blocker.start()
    assert blocker.decoding.wait(300)
    queued_since = _last_seq(draft)
    offset = len(draft.log_text())
    threads = [threading.Thread(target=send, args=(t, f, k)) for k, (t, f) in enumerate(zip(tenants, firsts))]
    for thread in threads:
        thread.start()
    # mlx-vlm's generator logs each request it takes from its queue into the decoding batch's
    # waiting prompts: both are in, so ending the stream admits them together.
    wait_for(lambda: draft.log_text()[offset:].count("Prefill started") >= 2, "both second turns queued", draft,
             timeout=300)
    assert blocker.is_alive(), "the stream ended before both second turns were queued"
    blocker.stop()
    for thread in threads:
        thread.join()
    blocker.join()
    assert not errors, errors
    # Both rows ended in a shared batch and kept their replies there (a lone row's is adopted,
    # logged as a commit): the rounds' row order was used, not each row alone.
    assert draft.log_text().count("apc_lineage reply kept") - shared_before == 2, draft.log_tail()
    # Queued while the speculative stream decoded, yet not staged: mlx-vlm admits no prompt while
    # a speculative batch decodes (ar.py: its `next` returns before the prompt batch), so their
    # merge copies ran when it had ended, beside no decoding row (docs/models.md, "Staged").
    queued = [r for r in _records(draft, queued_since) if r["restored_tokens"] > 0]  # not the cold stream
    assert sorted(r["kv_admission"] for r in queued) == ["copied", "copied"], queued
    for k, tenant in enumerate(tenants):
        second = seconds[tenant]
        since = _last_seq(draft)
        third = reuse.ask(draft, tokenizer, reuse.follow_up(second, text(12, 531 + k)), tenant)
        (record,) = _records(draft, since)
        assert record["restored_tokens"] > len(second.prompt), record  # past its own second reply
        assert_same_tokens(third.answer, _cold(draft, third.messages))
        assert_same_tokens(third.answer, _cold(plain, third.messages))
