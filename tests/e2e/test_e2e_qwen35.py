"""End to end on qwen3_5 (Gated DeltaNet hybrid), the family most Mac users run.

Real patched server, real HTTP, a random qwen3_5 directory with its own BPE tokenizer and
ChatML template (``apcctl.lab.tinymodel.servable``): a growing conversation restores its entry, a new
session lands on the system-prompt anchor, a second system-prompt variant restores at the
divergence, and an image prompt restores only inside its own media namespace. Every warm
answer equals a cold prefill's (a fresh tenant: nothing to restore from).
"""

from __future__ import annotations

import base64
import io
import itertools

import pytest

from tests.server_harness import (PatchedServer, assert_next_turn_restored, assert_same_output, cached_tokens,
                            reply_text, text)

_cold_tenants = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from apcctl.lab.tinymodel.servable import build_qwen35

    model_dir = build_qwen35(tmp_path_factory.mktemp("qwen35") / "model")
    srv = PatchedServer(model_dir, env={"TOP_LOGPROBS_K": "5"},
                        log_dir=tmp_path_factory.mktemp("e2e-qwen35"))
    srv.start()
    yield srv
    srv.stop()


def _chat(server: PatchedServer, messages: list[dict], tenant: str) -> tuple[dict, dict]:
    """One request and the restore line it logged."""
    return server.chat_restore(messages, tenant=tenant, max_tokens=4, logprobs=True, top_logprobs=5)


def _assert_equals_cold(server: PatchedServer, messages: list[dict], warm: dict) -> None:
    cold, line = _chat(server, messages, tenant=f"cold-{next(_cold_tenants)}")
    assert line["kind"] == "cold", line
    assert_same_output(warm, cold)


def _image(color: str) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.server
def test_growing_conversation_restores_its_entry_and_equals_cold(server):
    messages = [{"role": "system", "content": text(200, 1)}, {"role": "user", "content": text(60, 2)}]
    first, line = _chat(server, messages, "conversation")
    assert line["kind"] == "cold"
    for turn in range(2):
        messages += [{"role": "assistant", "content": reply_text(first)},
                     {"role": "user", "content": text(40, 3 + turn)}]
        answer, line = _chat(server, messages, "conversation")
        assert_next_turn_restored(first, answer, line["kind"])
        _assert_equals_cold(server, messages, answer)
        first = answer


@pytest.mark.server
def test_new_session_lands_on_the_system_prompt_anchor(server):
    system = {"role": "system", "content": text(250, 5)}
    _chat(server, [system, {"role": "user", "content": text(50, 6)}], "sessions")
    status, body = server.admin("GET", "/anchors")
    assert status == 200
    lengths = {a["length"] for a in body["anchors"]}
    second = [system, {"role": "user", "content": text(50, 7)}]
    answer, line = _chat(server, second, "sessions")
    assert line["kind"] == "anchor" and cached_tokens(answer) in lengths, (line, lengths)
    _assert_equals_cold(server, second, answer)


@pytest.mark.server
def test_second_system_prompt_variant_restores_at_the_divergence(server):
    base = text(300, 8)
    def prompt(system: str, user_seed: int) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": text(40, user_seed)}]

    variant = prompt(base + " " + text(30, 9), 10)
    _chat(server, prompt(base, 11), "variants")
    # The first variant diverges inside the system text, where nothing is stored yet (and the
    # 2048-token periodic floor is further on): cold, as for stock.
    _, line = _chat(server, variant, "variants")
    assert line["kind"] == "cold"
    # It captured the divergence: the next variant from the same base restores there.
    other = prompt(base + " " + text(30, 12), 13)
    answer, line = _chat(server, other, "variants")
    assert line["kind"] == "divergence" and cached_tokens(answer) >= 300, line
    _assert_equals_cold(server, other, answer)


@pytest.mark.server
def test_image_prompt_restores_only_in_its_own_media_namespace(server):
    def conversation(color: str, reply: str = "") -> list[dict]:
        messages = [{"role": "system", "content": text(100, 14)},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _image(color)}},
                                                 {"type": "text", "text": text(40, 15)}]}]
        if reply:
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": text(30, 16)}]
        return messages

    first, line = _chat(server, conversation("red"), "media")
    assert line["kind"] == "cold"
    red = conversation("red", reply_text(first))
    answer, line = _chat(server, red, "media")
    assert_next_turn_restored(first, answer, line["kind"])
    _assert_equals_cold(server, red, answer)
    # Same tokens around the image, other pixels: nothing of the red namespace may be reused.
    blue = conversation("blue", reply_text(first))
    answer, line = _chat(server, blue, "media")
    assert line["kind"] == "cold" and cached_tokens(answer) == 0, line
    _assert_equals_cold(server, blue, answer)
