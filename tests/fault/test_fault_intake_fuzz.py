"""Property tests: every intake check walks any JSON a client may send without raising (issue 34, item 1).

A check may answer "refuse" (a sentence, or the project's own 400 ``RequestRefused``); it may not
raise anything else, since an exception in the body guard is a 500 for a body stock mlx-vlm
answers. The bodies are arbitrary JSON values (NaN, lone surrogates and media-looking keys
included) and the agent tool schemas of ``tests/fixtures/agent_tool_schemas`` inside chat and
Responses requests, with arbitrary JSON grafted anywhere into them. No DNS: the URL check gets a
resolver of the test's own, and the ASGI guard runs with private URLs allowed.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import ipaddress
import json
import pkgutil
import socket
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import server_patch.intake
from server_patch.intake import checks, data_images, logit_bias, media
from server_patch.intake.body import InferenceBodyGuard
from server_patch.intake.limits import IntakeLimits
from tests.fixtures import agent_tool_schemas as agents
from tests.fixtures import inline_images

# The keys the checks look at, so random dicts often hit their branches.
KEYS = sorted(media.MEDIA_KEYS | media.REFERENCE_KEYS
              | {"type", "messages", "input", "tools", "input_audio", "data", "logit_bias", "source", "content",
                 "media_type"})
TYPES = sorted(media.MEDIA_TYPES | {"function", "object", "text", "base64"})
MEDIA_TEXT = ["data:image/png;base64,", "data:image/png;base64,!!", "data:image/png", "http://[::1", "/tmp/a\x00b",
              "file:///x\x00", "./clip.wav", "http://93.184.216.34/a.png", "ftp://x/y", "\ud800", "C:\\x.png",
              inline_images.data_uri(inline_images.noise_png(4)), *inline_images.BROKEN.values()]

scalars = (st.none() | st.booleans() | st.integers() | st.floats()  # NaN and infinities: json.loads takes them
           | st.text(max_size=12) | st.sampled_from(MEDIA_TEXT + TYPES))
keys = st.sampled_from(KEYS) | st.text(max_size=8)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=24,
)


def graft(tree: Any, value: Any, choices: list[int]) -> Any:
    """``tree`` with ``value`` put at a place ``choices`` picks: a dict key's value or a list item."""
    tree = copy.deepcopy(tree)
    node = tree
    for choice in choices:
        children = list(node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ())
        if not children:
            break
        key, child = children[choice % len(children)]
        if not isinstance(child, (dict, list)) or choice % 3 == 0:
            node[key] = value
            return tree
        node = child
    return tree


@st.composite
def agent_bodies(draw: Callable[..., Any]) -> Any:
    """A chat or Responses body with the fixture tools, arbitrary JSON grafted somewhere into it."""
    body = draw(st.sampled_from([agents.chat_body("m"), agents.responses_body("m")]))
    if draw(st.booleans()):
        return body
    return graft(body, draw(json_values), draw(st.lists(st.integers(0, 50), min_size=1, max_size=12)))


bodies = json_values | agent_bodies()


def no_dns(host: str, port: int, **_: Any) -> list:
    """A resolver of the test's own: IP literals as themselves, any other name one public address."""
    try:
        return [(socket.AF_INET, socket.SOCK_STREAM, 0, "", (str(ipaddress.ip_address(host)), port))]
    except ValueError:
        return [(socket.AF_INET, socket.SOCK_STREAM, 0, "", ("93.184.216.34", port))]


POLICIES = (media.MediaPolicy(), media.MediaPolicy(local_root="/tmp"), media.MediaPolicy(private_urls=True))

# Every public function in server_patch.intake that reads client JSON, and how it is called here.
BODY_CHECKS: dict[str, Callable[[Any], Any]] = {
    "checks.too_deep": lambda data: checks.too_deep(data, 8),
    "checks.has_lone_surrogate": checks.has_lone_surrogate,
    "checks.refusal": lambda data: [checks.refusal(path, data, 8) for path in [*checks.MESSAGE_ROUTES, "/v1/responses"]],
    "media.references": lambda data: list(media.references(data)),
    "logit_bias.checked": lambda data: logit_bias.checked(data, 1000),
    "data_images.refusal": lambda data: data_images.refusal(data),
    "data_images.anthropic_sources": lambda data: list(data_images.anthropic_sources(data)),
    "media.refusal": lambda data: [media.refusal(data, policy, no_dns) for policy in POLICIES],
    "media.local_refusal": lambda data: [media.local_refusal(data, policy) for policy in POLICIES],
}
# A public intake function whose first parameter is one of these reads client JSON: it must be above.
CLIENT_PARAMETERS = {"data", "reference", "logit_bias"}


# These take one string a body names (a media reference); they get every string the walks find.
TEXT_CHECKS = {"data_images.refusal", "media.refusal", "media.local_refusal"}


def call_check(name: str, value: Any) -> None:
    """Run one check; only its deliberate refusal (the project's 400) may come out."""
    inputs = [value]
    if name in TEXT_CHECKS:
        inputs = [*media.references(value), *data_images.anthropic_sources(value)]
        inputs += [value] if isinstance(value, str) else []
    for item in inputs:
        try:
            BODY_CHECKS[name](item)
        except logit_bias.RequestRefused:
            pass


def test_every_public_check_that_reads_client_json_is_fuzzed() -> None:
    found = set()
    for info in pkgutil.iter_modules(server_patch.intake.__path__):
        module = importlib.import_module(f"server_patch.intake.{info.name}")
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("_") or function.__module__ != module.__name__:
                continue
            parameters = list(inspect.signature(function).parameters)
            if parameters and parameters[0] in CLIENT_PARAMETERS:
                found.add(f"{info.name}.{name}")
    assert found <= set(BODY_CHECKS), f"not fuzzed: {sorted(found - set(BODY_CHECKS))}"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=bodies)
@example(value=agents.chat_body("m", tools=[{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"limit": {"type": ["integer", "null"]}}}}}]))
@example(value={"type": ["integer", "null"]})
@example(value={"type": {"type": "string"}})
@example(value=["http://[::1", "/tmp/a\x00b", "data:image/png;base64,!!"])
def test_no_check_raises_on_any_json(value: Any) -> None:
    for name in BODY_CHECKS:
        call_check(name, value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/responses", "/v1/messages", "/chat"]))
def test_the_body_guard_answers_400_or_passes_every_json_body_on(value: Any, path: str) -> None:
    """The ASGI guard itself, in front of an app that records what reached it: never an exception."""
    raw = json.dumps(value).encode()
    status, passed = asyncio.run(run_guard(raw, path))
    assert (status, passed) in ((200, raw), (400, None)), (status, passed)


def test_the_agent_tools_pass_the_guard_unchanged() -> None:
    for body, path in ((agents.chat_body("m"), "/v1/chat/completions"), (agents.responses_body("m"), "/v1/responses")):
        raw = json.dumps(body).encode()
        assert asyncio.run(run_guard(raw, path, private_urls=False)) == (200, raw)


async def run_guard(raw: bytes, path: str, private_urls: bool = True) -> tuple[int, bytes | None]:
    """(status, body the app got or None) for one POST through ``InferenceBodyGuard``."""
    got: list[bytes] = []
    sent: list[dict] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        message = await receive()
        got.append(message.get("body", b""))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    guard = InferenceBodyGuard(app, limits=IntakeLimits(), policy=media.MediaPolicy(private_urls=private_urls))
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    await guard(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    if status == 400:
        body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
        assert isinstance(body["detail"], str) and body["detail"], body
    return status, (got[0] if got else None)


@pytest.mark.parametrize("case", sorted(inline_images.BROKEN) + ["no comma"])
def test_a_broken_data_image_is_refused_with_a_reason(case: str) -> None:
    why = data_images.refusal(inline_images.BROKEN.get(case, "data:image/png;base64"))
    assert why and "inline image" in why, (case, why)


def test_a_whole_data_image_and_other_references_are_not_data_images_checks() -> None:
    whole = inline_images.data_uri(inline_images.noise_png(16))
    assert data_images.refusal(whole) is None
    assert data_images.refusal(whole.replace(",", ",\n", 1)) is None  # lenient base64 skips junk, as stock's does
    for other in ("http://example.com/a.png", "/tmp/a.png", "data:audio/wav;base64,!!", 5, None):
        assert data_images.refusal(other) is None


def test_anthropic_base64_blocks_become_the_uris_mlx_vlm_builds() -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}},
        {"type": "tool_result", "content": [{"type": "image", "source": {"type": "base64", "data": "BBBB"}}]},
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
        {"type": "image", "source": {"type": "base64", "data": ""}}]}]}
    assert sorted(data_images.anthropic_sources(body)) == ["data:image/jpeg;base64,AAAA", "data:image/png;base64,BBBB"]


def test_url_and_path_oddities_are_refusals_not_exceptions() -> None:
    for reference in ("http://[::1", "https://[zz]/a.png", "/tmp/a\x00b", "file:///tmp/\x00"):
        for policy in POLICIES:
            why = media.refusal(reference, policy, no_dns)
            assert why is None or isinstance(why, str)
        assert media.refusal(reference, POLICIES[1], no_dns), reference
