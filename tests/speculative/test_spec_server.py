"""A real server with the tiny model's MTP drafter and the lineage cache on: every restore kind
answers what a cold prefill answers with the same drafter, and what the model answers without one.

Greedy tokens are compared, 24 of them (mlx-vlm 0.7.10's speculative path reports every
logprob as 0.0 with no top_logprobs, so the logprob half of ``assert_same_output`` has nothing
to compare); the scenarios that produce each kind are test_e2e_correctness's. ``disk``: the drafter server is stopped (its shutdown flushes RAM to
disk) and a second drafter server on the same disk directory continues the conversation.
Each warm answer also says speculation ran (``timings.draft_kind`` mtp, drafts proposed).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_e2e_correctness import PARAMS as WARMUP_PARAMS, SCENARIOS
from tests.server_harness import PatchedServer, reply_text, reply_tokens, text

PARAMS = {**WARMUP_PARAMS, "max_tokens": 24}

KINDS = ("entry", "final", "anchor", "divergence")


def _drafter_args(drafter: Path) -> list[str]:
    return ["--draft-model", str(drafter), "--draft-kind", "mtp"]


def _env(disk: Path) -> dict[str, str]:
    return {"TOP_LOGPROBS_K": "5", "APC_LINEAGE_DISK": "1", "APC_LINEAGE_DISK_PATH": str(disk)}


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tiny_drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("spec-server")
    started = {
        "default": PatchedServer(tiny_model_dir, env=_env(root / "disk-draft"), log_dir=root / "draft",
                                 args=_drafter_args(tiny_drafter_dir)),
        "plain": PatchedServer(tiny_model_dir, env=_env(root / "disk-plain"), log_dir=root / "plain"),
    }
    try:
        for server in started.values():
            server.start()
        yield started
    finally:
        for server in started.values():
            server.stop()


def _assert_speculated(answer: dict[str, Any]) -> None:
    timings = answer.get("timings") or {}
    assert timings.get("draft_kind") == "mtp" and int(timings.get("draft_n") or 0) > 0, timings


def assert_same_tokens(warm: dict[str, Any], cold: dict[str, Any]) -> None:
    tokens = reply_tokens(warm)
    assert tokens and tokens == reply_tokens(cold), (warm["choices"][0]["message"], cold["choices"][0]["message"])


def _cold(server: PatchedServer, messages: list[dict], **extra: Any) -> dict:
    answer, line = server.chat_restore(messages, tenant=f"cold-{uuid.uuid4().hex[:8]}", **PARAMS, **extra)
    assert line["kind"] == "cold", line
    return answer


@pytest.mark.server
@pytest.mark.parametrize("kind", KINDS)
def test_warm_turn_with_a_drafter_equals_cold_and_no_drafter(kind: str, servers: dict[str, PatchedServer]) -> None:
    tenant = f"spec-{kind}"
    _, messages, extra = SCENARIOS[kind](servers, tenant)
    server = servers["default"]
    warm, line = server.chat_restore(messages, tenant=tenant, **PARAMS, **extra)
    assert line["kind"] == kind and int(line["restored"]) > 0, line
    _assert_speculated(warm)
    assert_same_tokens(warm, _cold(server, messages, **extra))
    assert_same_tokens(warm, _cold(servers["plain"], messages, **extra))


@pytest.mark.server
def test_disk_restore_with_a_drafter_equals_no_drafter(tiny_model_dir: Path, tiny_drafter_dir: Path,
                                                       tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    turn0 = [{"role": "system", "content": text(300, 391)}, {"role": "user", "content": text(200, 392)}]
    first = PatchedServer(tiny_model_dir, env=_env(disk), log_dir=tmp_path / "one",
                          args=_drafter_args(tiny_drafter_dir))
    try:
        first.start()
        answer, _ = first.chat_restore(turn0, tenant="disk", **PARAMS)
    finally:
        first.stop(timeout=60)
    turn1 = turn0 + [{"role": "assistant", "content": reply_text(answer)},
                     {"role": "user", "content": text(80, 393)}]
    second = PatchedServer(tiny_model_dir, env=_env(disk), log_dir=tmp_path / "two",
                           args=_drafter_args(tiny_drafter_dir))
    plain = PatchedServer(tiny_model_dir, env=_env(tmp_path / "disk-plain"), log_dir=tmp_path / "plain")
    try:
        second.start()
        plain.start()
        warm, line = second.chat_restore(turn1, tenant="disk", **PARAMS)
        assert line["kind"] == "disk" and int(line["restored"]) > 0, line
        _assert_speculated(warm)
        assert_same_tokens(warm, _cold(second, turn1))
        assert_same_tokens(warm, _cold(plain, turn1))
    finally:
        second.stop()
        plain.stop()
