"""A real server with the tiny model's MTP drafter and the lineage cache on: every restore kind
answers what a cold prefill answers with the same drafter, and what the model answers without one.

Greedy replies are compared, 24 tokens each, as text and token count: mlx-vlm 0.7.10's
speculative path computes no logprobs (it reported every one as 0.0), so a drafter server
refuses requests that ask for them (400) and the comparison cannot use them. The scenarios that
produce each kind are test_e2e_correctness's, sent without logprobs. ``disk``: the drafter server is stopped (its shutdown flushes RAM to
disk) and a second drafter server on the same disk directory continues the conversation.
Each warm answer also says speculation ran (``timings.draft_kind`` mtp, drafts proposed).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import test_e2e_correctness as correctness
from tests.e2e.test_e2e_correctness import SCENARIOS
from tests.server_harness import all_running, PatchedServer, reply_text, text

PARAMS = {"max_tokens": 24}

KINDS = ("entry", "final", "anchor", "divergence")


def _drafter_args(drafter: Path) -> list[str]:
    return ["--draft-model", str(drafter), "--draft-kind", "mtp"]


def _env(disk: Path) -> dict[str, str]:
    return {"TOP_LOGPROBS_K": "5", "APC_LINEAGE_DISK": "1", "APC_LINEAGE_DISK_PATH": str(disk)}


@pytest.fixture(scope="module")
def servers(spec_model_dir: Path, spec_drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("spec-server")
    started = {
        "default": PatchedServer(spec_model_dir, env=_env(root / "disk-draft"), log_dir=root / "draft",
                                 args=_drafter_args(spec_drafter_dir)),
        "plain": PatchedServer(spec_model_dir, env=_env(root / "disk-plain"), log_dir=root / "plain"),
    }
    with all_running(started):
        yield started


def _assert_speculated(answer: dict[str, Any]) -> None:
    timings = answer.get("timings") or {}
    assert timings.get("draft_kind") == "mtp" and int(timings.get("draft_n") or 0) > 0, timings


def acceptance(answer: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The request's speculation (rounds, drafted, accepted): exact for a lone request."""
    timings = answer.get("timings") or {}
    counts = timings.get("draft_rounds"), timings.get("draft_n"), timings.get("draft_n_accepted")
    assert None not in counts, timings
    return counts


def assert_same_tokens(warm: dict[str, Any], cold: dict[str, Any]) -> None:
    def reply(answer: dict[str, Any]) -> tuple[str, int]:
        return answer["choices"][0]["message"]["content"], int(answer["usage"]["completion_tokens"])

    assert reply(warm)[1] > 0 and reply(warm) == reply(cold), (reply(warm), reply(cold))


def _cold(server: PatchedServer, messages: list[dict], **extra: Any) -> dict:
    answer, line = server.chat_restore(messages, tenant=f"cold-{uuid.uuid4().hex[:8]}", **PARAMS, **extra)
    assert line["kind"] == "cold", line
    return answer


@pytest.mark.server
@pytest.mark.parametrize("kind", KINDS)
def test_warm_turn_with_a_drafter_equals_cold_and_no_drafter(kind: str, servers: dict[str, PatchedServer],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(correctness, "PARAMS", PARAMS)  # the scenarios' warm-up turns, no logprobs
    tenant = f"spec-{kind}"
    _, messages, extra = SCENARIOS[kind](servers, tenant)
    server = servers["default"]
    warm, line = server.chat_restore(messages, tenant=tenant, **PARAMS, **extra)
    assert line["kind"] == kind and int(line["restored"]) > 0, line
    _assert_speculated(warm)
    cold = _cold(server, messages, **extra)
    assert_same_tokens(warm, cold)
    assert acceptance(warm) == acceptance(cold)  # the drafter drafts and is accepted as cold
    assert_same_tokens(warm, _cold(servers["plain"], messages, **extra))


@pytest.mark.server
def test_disk_restore_with_a_drafter_equals_no_drafter(spec_model_dir: Path, servers: dict[str, PatchedServer],
                                                       tmp_path: Path) -> None:
    """Two drafter servers in turn on one disk directory: the module's drafter server answers
    the first turn and is stopped; a new one on its disk directory takes its place in the module
    (the same settings: later tests are served by it) and restores the second turn from disk.
    The module's server without a drafter answers the same turn cold."""
    first = servers["default"]
    turn0 = [{"role": "system", "content": text(150, 391)}, {"role": "user", "content": text(100, 392)}]
    answer, _ = first.chat_restore(turn0, tenant="disk", **PARAMS)
    first.stop(timeout=60)
    turn1 = turn0 + [{"role": "assistant", "content": reply_text(answer)},
                     {"role": "user", "content": text(80, 393)}]
    second = PatchedServer(spec_model_dir, env=_env(Path(first.env["APC_LINEAGE_DISK_PATH"])),
                           log_dir=tmp_path / "two", args=first.args)
    servers["default"] = second  # the module's fixture stops it at the end, whatever happens here
    second.start()
    warm, line = second.chat_restore(turn1, tenant="disk", **PARAMS)
    assert line["kind"] == "disk" and int(line["restored"]) > 0, line
    _assert_speculated(warm)
    cold = _cold(second, turn1)
    assert_same_tokens(warm, cold)
    assert acceptance(warm) == acceptance(cold)
    assert_same_tokens(warm, _cold(servers["plain"], turn1))


@pytest.mark.server
def test_a_drafter_server_refuses_logprobs_it_cannot_compute(servers: dict[str, PatchedServer]) -> None:
    messages = [{"role": "user", "content": text(20, 399)}]
    for extra in ({"logprobs": True}, {"logprobs": True, "top_logprobs": 5}):
        status, body = servers["default"].request(
            "POST", "/v1/chat/completions",
            {"model": str(servers["default"].model_dir), "messages": messages, "max_tokens": 4, **extra})
        assert status == 400 and "speculative decoding" in str(body), (status, body)
    assert servers["plain"].chat(messages, max_tokens=4, logprobs=True, top_logprobs=5)["choices"][0]["logprobs"]


@pytest.mark.server
def test_two_warm_turns_speculating_together_each_equal_cold(servers: dict[str, PatchedServer]) -> None:
    """Two restored rows sent at once (mlx-vlm coalesces speculative requests into one left-padded
    batch when they arrive together; this test does not prove they shared one)."""
    import threading

    server = servers["default"]
    second_turns = []
    for seed in (401, 411):
        turn0 = [{"role": "system", "content": text(250, seed)}, {"role": "user", "content": text(150, seed + 1)}]
        first, _ = server.chat_restore(turn0, tenant=f"pair-{seed}", **PARAMS)
        second_turns.append((f"pair-{seed}", turn0 + [{"role": "assistant", "content": reply_text(first)},
                                                      {"role": "user", "content": text(60 + seed % 7, seed + 2)}]))
    before = len(server.lineage_lines("restore"))
    answers: dict[str, dict] = {}
    errors: list[BaseException] = []

    def send(tenant: str, messages: list[dict]) -> None:
        try:
            answers[tenant] = server.chat(messages, tenant=tenant, **PARAMS)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=turn) for turn in second_turns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    kinds = sorted(line["kind"] for line in server.lineage_lines("restore")[before:])
    assert kinds == ["entry", "entry"], kinds
    for tenant, messages in second_turns:
        _assert_speculated(answers[tenant])
        assert_same_tokens(answers[tenant], _cold(server, messages))
        assert_same_tokens(answers[tenant], _cold(servers["plain"], messages))
