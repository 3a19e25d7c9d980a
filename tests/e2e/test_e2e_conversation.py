"""End to end, real HTTP against a real patched server: conversations hit their own lineage.

* a multi-turn conversation restores its entry every turn (at n - 1) and RAM holds one entry
  per lineage, with the earlier turn boundaries as ``final`` checkpoints;
* an edited last message, a regenerate and a retry after a dropped stream land on a
  checkpoint or the entry, never on a cold prefill;
* concurrent conversations and concurrent requests sharing a long prefix all succeed, and
  their next turns hit their own lineages.

One server for the module; every test uses its own ``X-APC-Tenant`` so they never share entries.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import cached_tokens, fed_tokens as fed, PatchedServer, prompt_tokens, reply_text, text


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = PatchedServer(tiny_model_dir, env={"TOP_LOGPROBS_K": "5"},
                        log_dir=tmp_path_factory.mktemp("e2e-conversation"))
    srv.start()
    yield srv
    srv.stop()


def _last_restore(server: PatchedServer, before: int) -> dict[str, str]:
    lines = server.lineage_lines("restore")
    assert len(lines) == before + 1, f"expected one new restore line, log tail:\n{server.log_tail()}"
    return lines[-1]


def _chat_logged(server: PatchedServer, messages: list[dict], **params: Any) -> tuple[dict, dict]:
    """One sequential request and the restore line it logged."""
    before = len(server.lineage_lines("restore"))
    answer = server.chat(messages, **params)
    return answer, _last_restore(server, before)


def _conversation_entries(server: PatchedServer, namespace: str) -> list[dict]:
    status, body = server.admin("GET", "/entries?kind=conversation&tier=ram")
    assert status == 200, body
    return [e for e in body["entries"] if e["namespace"] == namespace]


def _kv_admissions(server: PatchedServer) -> dict[str, float]:
    """``apc_lineage_kv_admissions_total`` by mode, from the Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text_body = server.admin("GET", "/metrics")
    assert status == 200, text_body
    return {s.labels["mode"]: s.value for family in text_string_to_metric_families(text_body)
            if family.name == "apc_lineage_kv_admissions" for s in family.samples if s.name.endswith("_total")}


def _namespace_of(server: PatchedServer, length: int) -> str:
    """The namespace of the conversation entry of exactly ``length`` tokens (tenants are hashed)."""
    status, body = server.admin("GET", "/entries?kind=conversation&tier=ram")
    assert status == 200, body
    found = {e["namespace"] for e in body["entries"] if e["length"] == length}
    assert len(found) == 1, f"no unique conversation entry of length {length}: {body['entries']}"
    return found.pop()


@pytest.mark.server
def test_multi_turn_hits_its_lineage_and_keeps_one_entry(server: PatchedServer) -> None:
    tenant = "conv-multi-turn"
    messages = [{"role": "system", "content": text(300, 1)},
                {"role": "user", "content": text(120, 2)}]
    prompts, cached, kinds, admissions, fed_lengths = [], [], [], [], []
    counted = _kv_admissions(server)
    for turn in range(4):
        answer, line = _chat_logged(server, messages, tenant=tenant, max_tokens=4)
        prompts.append(prompt_tokens(answer))
        fed_lengths.append(fed(answer))
        cached.append(cached_tokens(answer))
        kinds.append(line["kind"])
        admissions.append(line["kv"])
        assert int(line["prompt"]) == prompts[-1]
        assert int(line["restored"]) == cached[-1]
        messages += [{"role": "assistant", "content": reply_text(answer)},
                     {"role": "user", "content": text(60, 10 + turn)}]

    # Every later turn restores the previous turn's entry, whose head sits past its reply.
    assert kinds[1:] == ["entry"] * 3, kinds
    assert cached[1:] == fed_lengths[:-1], (prompts, cached)
    assert kinds[0] == "cold" and cached[0] == 0
    # The first warm turn copies the entry once, into a buffer with room; the next turns are
    # lent the previous entry's own buffer and append in place.
    assert admissions == ["-", "copied", "lent", "lent"], admissions
    after = _kv_admissions(server)
    assert {m: after[m] - counted.get(m, 0) for m in ("lent", "copied")} == {"lent": 2, "copied": 1}

    # RAM: one conversation entry for this lineage, its earlier turn boundaries as checkpoints.
    namespace = _namespace_of(server, fed_lengths[-1])
    entries = _conversation_entries(server, namespace)
    assert len(entries) == 1, entries
    entry = entries[0]
    assert entry["length"] == fed_lengths[-1]
    finals = sorted(c["length"] for c in entry["checkpoints"] if c["kind"] == "final")
    assert {n - 1 for n in prompts} <= set(finals), entry["checkpoints"]  # every prompt end (+ reply ends)


@pytest.mark.server
def test_edit_regenerate_and_dropped_stream_retry_are_warm(server: PatchedServer) -> None:
    tenant = "conv-edit-retry"
    system = {"role": "system", "content": text(250, 21)}
    turn0 = [system, {"role": "user", "content": text(150, 22)}]
    first, _ = _chat_logged(server, turn0, tenant=tenant, max_tokens=4)
    turn1 = turn0 + [{"role": "assistant", "content": reply_text(first)},
                     {"role": "user", "content": text(150, 23)}]
    second, line = _chat_logged(server, turn1, tenant=tenant, max_tokens=4)
    assert line["kind"] == "entry" and cached_tokens(second) == fed(first)

    # An edited last message: the previous turn boundary (a final checkpoint) or later.
    edited = turn1[:-1] + [{"role": "user", "content": text(150, 24)}]
    answer, line = _chat_logged(server, edited, tenant=tenant, max_tokens=4)
    assert line["kind"] in ("final", "divergence", "guard", "periodic", "reply"), line
    assert cached_tokens(answer) >= prompt_tokens(first) - 1, (line, prompt_tokens(first))

    # An edit of the last words only: still at least the turn boundary.
    tail_edit = turn1[:-1] + [{"role": "user", "content": text(146, 23) + " apple banana orange water"}]
    answer, line = _chat_logged(server, tail_edit, tenant=tenant, max_tokens=4)
    assert line["kind"] != "cold" and cached_tokens(answer) >= prompt_tokens(first) - 1, line

    # A regenerate (identical resend): the entry at n - 1 (rewound from past its reply to be
    # lent its buffer), and the same greedy reply.
    again, line = _chat_logged(server, turn1, tenant=tenant, max_tokens=4)
    assert line["kind"] == "entry", line
    assert cached_tokens(again) == prompt_tokens(second) - 1
    assert reply_text(again) == reply_text(second)

    # A retry after a dropped stream: the dropped request's entry holds what it was fed; the
    # retry of the identical prompt restores at its prompt end, n - 1.
    turn2 = turn1 + [{"role": "assistant", "content": reply_text(second)},
                     {"role": "user", "content": text(120, 25)}]
    before = len(server.lineage_lines("restore"))
    chunks = server.stream_and_drop(turn2, chunks=2, tenant=tenant, max_tokens=200)
    assert chunks, "the stream produced no data before it was dropped"
    retry = server.chat(turn2, tenant=tenant, max_tokens=4)
    lines = server.lineage_lines("restore")
    assert len(lines) == before + 2, server.log_tail()
    dropped_line, retry_line = lines[-2], lines[-1]
    assert dropped_line["kind"] == "entry" and int(dropped_line["restored"]) == fed(second)
    assert retry_line["kind"] == "entry", retry_line
    assert cached_tokens(retry) == prompt_tokens(retry) - 1

    # The server is still healthy and the lineage continues.
    turn3 = turn2 + [{"role": "assistant", "content": reply_text(retry)},
                     {"role": "user", "content": text(40, 26)}]
    answer, line = _chat_logged(server, turn3, tenant=tenant, max_tokens=4)
    assert line["kind"] == "entry" and cached_tokens(answer) == fed(retry)


def _run_concurrently(calls: list) -> list[Any]:
    """Run zero-argument callables in threads released together; re-raise the first error."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a concurrent request hung"
    if errors:
        raise errors[0]
    return results


def _max_in_flight(server: PatchedServer, since_chars: int) -> int:
    import re

    found = [int(m) for m in re.findall(r"Request started: .*in_flight=(\d+)", server.log_text()[since_chars:])]
    return max(found, default=0)


@pytest.mark.server
def test_parallel_conversations_hit_their_lineages(server: PatchedServer) -> None:
    tenant = "conv-parallel"
    convs = [
        [{"role": "system", "content": text(400, 31)}, {"role": "user", "content": text(300, 32)}],
        [{"role": "system", "content": text(400, 33)}, {"role": "user", "content": text(300, 34)}],
    ]
    mark = len(server.log_text())
    previous: list[dict | None] = [None, None]
    for turn in range(3):
        answers = _run_concurrently([
            (lambda c=c: server.chat(c, tenant=tenant, max_tokens=12)) for c in convs
        ])
        for i, answer in enumerate(answers):
            if previous[i] is not None:
                assert cached_tokens(answer) == fed(previous[i]), (turn, i, answer["usage"])
            previous[i] = answer
            convs[i] = convs[i] + [{"role": "assistant", "content": reply_text(answer)},
                                   {"role": "user", "content": text(50, 40 + 2 * turn + i)}]
    assert _max_in_flight(server, mark) >= 2, "the two conversations never overlapped"


@pytest.mark.server
def test_shared_prefix_requests_in_flight_together(server: PatchedServer) -> None:
    tenant = "conv-shared-prefix"
    prefix = text(1200, 51)
    convs = [[{"role": "user", "content": prefix + " " + text(40, 52)}],
             [{"role": "user", "content": prefix + " " + text(40, 53)}]]
    mark = len(server.log_text())
    answers = _run_concurrently([
        (lambda c=c: server.chat(c, tenant=tenant, max_tokens=12)) for c in convs
    ])
    assert _max_in_flight(server, mark) >= 2, "the two requests never overlapped"
    for answer in answers:
        assert answer["usage"]["completion_tokens"] > 0

    # Identical prompts in flight together (two clients regenerating at once) also succeed.
    twins = _run_concurrently([(lambda: server.chat(convs[0], tenant=tenant, max_tokens=6))] * 2)
    assert reply_text(twins[0]) == reply_text(twins[1])

    # The next turn of each lineage restores its own entry: past its reply, or (the lineage
    # the twins regenerated, whose shorter replies replaced it) past the twins' common reply.
    for conv, answer in zip(convs, answers):
        follow = conv + [{"role": "assistant", "content": reply_text(answer)},
                         {"role": "user", "content": text(30, 54)}]
        nxt, line = _chat_logged(server, follow, tenant=tenant, max_tokens=4)
        assert line["kind"] == "entry", line
        assert prompt_tokens(answer) - 1 <= cached_tokens(nxt) <= fed(answer)


@pytest.mark.server
def test_post_layout_entry_offset_0_is_refused_at_startup(tiny_model_dir: Path, tmp_path: Path) -> None:
    """0.7.10 has no state at n, so the post's entry-at-n layout is refused, loudly, at start."""
    from tests.server_harness import ServerError

    server = PatchedServer(tiny_model_dir, log_dir=tmp_path, env={
        "APC_LINEAGE_ENTRY_OFFSET": "0", "APC_LINEAGE_GUARD_TOKENS": "16"})
    with pytest.raises(ServerError) as refused:
        server.start()
    assert "entry_offset" in (str(refused.value) + server.log_text()).lower()

