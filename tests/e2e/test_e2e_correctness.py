"""End to end: a warm request gives exactly what a cold prefill of the same prompt gives.

For each restore kind the server can produce, the warm request's greedy tokens and its first
token's top-5 logprobs are compared with a cold prefill of the same prompt on the same server
under a fresh ``X-APC-Tenant`` (a tenant never shares entries, so that request is really cold),
and with a server that has APC off entirely. Tolerance: 1e-3 on logprobs (float32), tokens equal.

Kinds and how they are produced (``entry``, ``final``, ``anchor``, ``divergence`` on a server
with the default configuration; ``periodic`` and ``guard`` on one with
``APC_LINEAGE_PERIODIC_STRIDE=256`` and ``APC_LINEAGE_GUARD_TOKENS=16``; ``disk`` is in
test_e2e_disk.py):

* entry: the second turn of a conversation;
* final: the second turn with its last user message edited (back to the turn boundary);
* anchor: a new session with the same system prompt and tools;
* divergence: three prompts sharing a long prefix; the second leaves a divergence checkpoint,
  the third restores it;
* periodic: a prompt sharing 600 of a 700-token prompt's tokens restores at 512;
* guard: a long prompt edited in its last few words restores at n - 16.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.server_harness import all_running, assert_same_output, PatchedServer, reply_text, text, words

MAX_TOKENS = 8
PARAMS = {"max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 5}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("e2e-correctness")
    base = {"TOP_LOGPROBS_K": "5"}
    # Each server its own directory: two lineage servers may not share a disk directory.
    started = {
        "default": PatchedServer(tiny_model_dir, env=base, log_dir=log_dir / "default"),
        "periodic": PatchedServer(tiny_model_dir, log_dir=log_dir / "periodic", env={
            **base, "APC_LINEAGE_PERIODIC_STRIDE": "256", "APC_LINEAGE_GUARD_TOKENS": "16"}),
        "apc_off": PatchedServer(tiny_model_dir, log_dir=log_dir / "apc_off", env={
            **base, "APC_LINEAGE": "0", "APC_ENABLED": "0"}),
    }
    with all_running(started):
        yield started


def _send(server: PatchedServer, messages: list[dict], tenant: str, **extra: Any) -> tuple[dict, dict]:
    return server.chat_restore(messages, tenant=tenant, **PARAMS, **extra)


# Each scenario warms the cache in its own tenant and returns (server name, warm messages,
# extra request fields); the last request it sends is the warm one.
Scenario = Callable[[dict[str, PatchedServer], str], tuple[str, list[dict], dict]]


def _entry(servers, tenant):
    server = servers["default"]
    turn0 = [{"role": "system", "content": text(300, 201)}, {"role": "user", "content": text(200, 202)}]
    first, _ = _send(server, turn0, tenant)
    return "default", turn0 + [{"role": "assistant", "content": reply_text(first)},
                               {"role": "user", "content": text(80, 203)}], {}


def _final(servers, tenant):
    server = servers["default"]
    turn0 = [{"role": "system", "content": text(300, 211)}, {"role": "user", "content": text(200, 212)}]
    first, _ = _send(server, turn0, tenant)
    turn1 = turn0 + [{"role": "assistant", "content": reply_text(first)}]
    _send(server, turn1 + [{"role": "user", "content": text(80, 213)}], tenant)
    return "default", turn1 + [{"role": "user", "content": text(80, 214)}], {}


def _anchor(servers, tenant):
    server = servers["default"]
    system = {"role": "system", "content": text(500, 221)}
    _send(server, [system, {"role": "user", "content": text(100, 222)}], tenant, tools=TOOLS)
    return "default", [system, {"role": "user", "content": text(100, 223)}], {"tools": TOOLS}


def _divergence(servers, tenant):
    server = servers["default"]
    prefix = text(700, 231)
    _send(server, [{"role": "user", "content": prefix + " " + text(60, 232)}], tenant)
    _send(server, [{"role": "user", "content": prefix + " " + text(60, 233)}], tenant)
    return "default", [{"role": "user", "content": prefix + " " + text(60, 234)}], {}


def _periodic(servers, tenant):
    server = servers["periodic"]
    body = words(700, 241)
    _send(server, [{"role": "user", "content": " ".join(body)}], tenant)
    return "periodic", [{"role": "user", "content": " ".join(body[:600] + words(100, 242))}], {}


def _guard(servers, tenant):
    server = servers["periodic"]
    body = words(700, 251)
    _send(server, [{"role": "user", "content": " ".join(body)}], tenant)
    return "periodic", [{"role": "user", "content": " ".join(body[:-4] + ["apple", "banana", "river", "ocean"])}], {}


SCENARIOS: dict[str, Scenario] = {
    "entry": _entry, "final": _final, "anchor": _anchor, "divergence": _divergence,
    "periodic": _periodic, "guard": _guard,
}


@pytest.mark.server
@pytest.mark.parametrize("kind", list(SCENARIOS))
def test_warm_restore_equals_cold_prefill(kind: str, servers: dict[str, PatchedServer]) -> None:
    tenant = f"warm-{kind}"
    name, messages, extra = SCENARIOS[kind](servers, tenant)
    server = servers[name]
    warm, line = _send(server, messages, tenant, **extra)
    assert line["kind"] == kind, line
    restored = int(line["restored"])
    assert restored > 0 and warm["usage"]["prompt_tokens_details"]["cached_tokens"] == restored

    cold, cold_line = _send(server, messages, f"cold-{uuid.uuid4().hex[:8]}", **extra)
    assert cold_line["kind"] == "cold" and cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_same_output(warm, cold)

    reference = servers["apc_off"].chat(messages, **PARAMS, **extra)
    assert reference["usage"]["prompt_tokens"] == warm["usage"]["prompt_tokens"]
    assert_same_output(warm, reference)


@pytest.mark.server
def test_the_comparison_sees_a_one_word_difference(servers: dict[str, PatchedServer]) -> None:
    """The oracle is tight enough: one word changed mid-prompt fails it (else the tests above
    could pass on a restore from the wrong state)."""
    server = servers["apc_off"]
    body = words(400, 261)
    changed = body[:200] + ["ocean" if body[200] != "ocean" else "river"] + body[201:]
    one = server.chat([{"role": "user", "content": " ".join(body)}], **PARAMS)
    other = server.chat([{"role": "user", "content": " ".join(changed)}], **PARAMS)
    with pytest.raises(AssertionError):
        assert_same_output(one, other)
