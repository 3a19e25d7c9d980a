"""The real patched server on other families than glm5_next and qwen3_5.

``gpt_oss`` alternates 8-token sliding-window layers (``RotatingKVCache``, snapshots) with full
attention layers; ``nemotron_h`` mixes Mamba2 layers (``ArraysCache``) with attention. Both
go through the batched server path (batch caches, row extraction, merges), which the
in-process conformance test does not. A growing conversation restores its entry, a new
session its anchor, and each answer equals a cold prefill's.
"""

from __future__ import annotations

import pytest

from apcctl.lab.tinymodel.servable import SERVED_END_TO_END

from tests.server_harness import (PatchedServer, assert_next_turn_restored, assert_same_output, cached_tokens,
                            reply_text, text)

PARAMS = {"max_tokens": 4, "logprobs": True, "top_logprobs": 5}


@pytest.fixture(scope="module", params=[f for f in SERVED_END_TO_END if f != "qwen3_5"])
def server(request, tmp_path_factory: pytest.TempPathFactory):
    from apcctl.lab.tinymodel.servable import build_family_dir

    family = request.param
    model_dir = build_family_dir(family, tmp_path_factory.mktemp(family) / "model")
    srv = PatchedServer(model_dir, env={"TOP_LOGPROBS_K": "5"},
                        log_dir=tmp_path_factory.mktemp(f"e2e-{family}"))
    srv.start()
    yield srv
    srv.stop()


def _chat(server: PatchedServer, messages: list[dict], tenant: str) -> tuple[dict, str]:
    answer, line = server.chat_restore(messages, tenant=tenant, **PARAMS)
    return answer, line["kind"]


@pytest.mark.server
def test_entry_and_anchor_restores_equal_cold(server):
    system = {"role": "system", "content": text(200, 1)}
    messages = [system, {"role": "user", "content": text(60, 2)}]
    first, kind = _chat(server, messages, "family")
    assert kind == "cold"
    messages += [{"role": "assistant", "content": reply_text(first)}, {"role": "user", "content": text(40, 3)}]
    warm, kind = _chat(server, messages, "family")
    assert_next_turn_restored(first, warm, kind)
    cold, kind = _chat(server, messages, "family-cold-1")
    assert kind == "cold"
    assert_same_output(warm, cold)

    session = [system, {"role": "user", "content": text(50, 4)}]
    warm, kind = _chat(server, session, "family")
    assert kind == "anchor" and cached_tokens(warm) > 150
    cold, kind = _chat(server, session, "family-cold-2")
    assert kind == "cold"
    assert_same_output(warm, cold)
