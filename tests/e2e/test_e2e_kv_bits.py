"""``--kv-bits`` end to end: the real patched server on qwen3_5 with a quantized KV cache.

Mac users run long contexts with mlx-vlm's quantized KV cache (``QuantizedKVCache``, packed
rows). The model is the tiny qwen3_5 with head_dim 64 (``mx.quantize`` packs groups of 64) and
an attention layer that is not the last (mlx-vlm keeps the last layer in float), so the server
really holds packed rows. A growing conversation restores its entry, a new session its anchor,
a system-prompt variant its divergence point; those lengths fall inside mlx-vlm's 256-row
allocation step and off the 64 group size. Every warm answer equals a cold prefill on a server
started with the same ``--kv-bits`` (a fresh tenant of the same server, and for 8 bits also a
stock server with the lineage off).
"""

from __future__ import annotations

import itertools

import pytest

from tests.server_harness import (PatchedServer, assert_next_turn_restored, assert_same_output, cached_tokens,
                            reply_text, text)

PARAMS = {"max_tokens": 4, "logprobs": True, "top_logprobs": 5}
OVERRIDES = {"head_dim": 64, "full_attention_interval": 2}
_cold = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    from apcctl.lab.tinymodel.servable import build_family_dir

    return build_family_dir("qwen3_5", tmp_path_factory.mktemp("qwen35-q") / "model", overrides=OVERRIDES)


@pytest.fixture(scope="module", params=[8, 4])
def server(request, model_dir, tmp_path_factory: pytest.TempPathFactory):
    bits = request.param
    srv = PatchedServer(model_dir, env={"TOP_LOGPROBS_K": "5"}, args=["--kv-bits", str(bits)],
                        log_dir=tmp_path_factory.mktemp(f"e2e-kv{bits}"))
    srv.start()
    srv.bits = bits
    yield srv
    srv.stop()


def _chat(server: PatchedServer, messages: list[dict], tenant: str) -> tuple[dict, dict]:
    return server.chat_restore(messages, tenant=tenant, **PARAMS)


def _equals_cold(server: PatchedServer, messages: list[dict], warm: dict) -> None:
    cold, line = _chat(server, messages, f"cold-{next(_cold)}")
    assert line["kind"] == "cold", line
    assert_same_output(warm, cold)


@pytest.mark.server
def test_quantized_restores_equal_a_cold_quantized_prefill(server, tmp_path_factory, model_dir):
    system = {"role": "system", "content": text(220, 11)}
    messages = [system, {"role": "user", "content": text(60, 12)}]
    first, line = _chat(server, messages, "kv")
    assert line["kind"] == "cold"
    assert "layout=arrays;qkv%dg64;arrays;kv" % server.bits in server.log_text(), server.log_tail()
    disk = [p.name for p in (server.log_dir / "lineage-disk").iterdir() if p.is_dir()]
    assert any(name.endswith("-qkv%dg64" % server.bits) for name in disk), disk  # never a float server's

    messages += [{"role": "assistant", "content": reply_text(first)}, {"role": "user", "content": text(40, 13)}]
    warm, line = _chat(server, messages, "kv")
    assert_next_turn_restored(first, warm, line["kind"])
    _equals_cold(server, messages, warm)
    conversation = (messages, warm)

    session = [system, {"role": "user", "content": text(50, 14)}]
    warm, line = _chat(server, session, "kv")
    assert line["kind"] == "anchor" and cached_tokens(warm) > 150
    _equals_cold(server, session, warm)

    def variant(ending: int, user: int) -> list[dict]:
        return [{"role": "system", "content": text(220, 11) + " " + text(20, ending)},
                {"role": "user", "content": text(50, user)}]

    _, line = _chat(server, variant(15, 16), "kv")  # diverges where nothing is stored yet: cold,
    assert line["kind"] == "cold"  # and captures the divergence
    warm_variant, line = _chat(server, variant(17, 18), "kv")
    assert line["kind"] == "divergence" and cached_tokens(warm_variant) > 150, line
    _equals_cold(server, variant(17, 18), warm_variant)

    restored = [cached_tokens(conversation[1]), cached_tokens(warm), cached_tokens(warm_variant)]
    assert any(n % 64 and n % 256 for n in restored), restored  # mid-group, mid-step restores

    if server.bits == 8:  # a stock server (lineage off) started with the same --kv-bits
        stock = PatchedServer(model_dir, env={"TOP_LOGPROBS_K": "5", "APC_LINEAGE": "0"},
                              args=["--kv-bits", "8"], log_dir=tmp_path_factory.mktemp("e2e-kv8-stock"))
        with stock:
            assert_same_output(conversation[1], stock.chat(conversation[0], **PARAMS))
