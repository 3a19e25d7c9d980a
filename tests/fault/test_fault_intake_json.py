"""Real coding agents' tool schemas and broken inline images against the real server (issue 34, items 1, 16).

qwen-code's ``read_file`` tool (``"type": ["integer", "null"]``) made every request of it a 500
from the body guard, on ``/v1/chat/completions`` and ``/v1/responses``; stock mlx-vlm 0.7.10
answers 200. Here the patched server and a stock one (``APC_LINEAGE=0``) answer the same bodies:
the fixture tools of ``tests/fixtures/agent_tool_schemas`` on both routes get stock's status and
stock's reply. A ``data:`` image with bad base64 or a truncated PNG is a 500 on both before the
fix (stock's loader raises in the handler), on chat, Responses and Anthropic's base64 image blocks;
the patched server answers 400 JSON and keeps serving.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.fixtures import agent_tool_schemas as agents
from tests.fixtures import inline_images
from tests.server_harness import PatchedServer

pytestmark = pytest.mark.server

READ_FILE_ONLY = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"limit": {"type": ["integer", "null"]}}}}}]


@pytest.fixture
def servers(patched: PatchedServer, stock: PatchedServer) -> dict[str, PatchedServer]:
    """The patched server and stock mlx-vlm on the same tiny model (the package's, shared)."""
    return {"patched": patched, "stock": stock}


def answer(server: PatchedServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, what the client reads: the reply's text and tool calls, or the error)."""
    status, reply = server.request("POST", path, body)
    if status != 200:
        return status, reply
    if path.endswith("/responses"):
        return status, [(item.get("type"), item.get("content"), item.get("name")) for item in reply["output"]]
    message = reply["choices"][0]["message"]
    return status, (message.get("content"), message.get("tool_calls"))


def request_pairs(model: str) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("read_file alone, chat", "/v1/chat/completions", agents.chat_body(model, tools=READ_FILE_ONLY)),
        ("read_file alone, responses", "/v1/responses", agents.responses_body(
            model, tools=[{"type": "function", **READ_FILE_ONLY[0]["function"]}])),
        ("every agent tool, chat", "/v1/chat/completions", agents.chat_body(model)),
        ("every agent tool, responses", "/v1/responses", agents.responses_body(model)),
    ]


def test_agent_tool_schemas_are_answered_as_stock_answers_them(servers: dict[str, PatchedServer]) -> None:
    patched, stock = servers["patched"], servers["stock"]
    before = len(patched.log_text())
    for case, path, body in request_pairs(str(patched.model_dir)):
        ours = answer(patched, path, body)
        assert ours[0] == 200, (case, ours)
        assert ours == answer(stock, path, body), case
    assert "Traceback" not in patched.log_text()[before:], patched.log_tail()


BROKEN_IMAGES = {case: inline_images.BROKEN[case]
                 for case in ("bad base64", "base64 cut mid-quantum", "PNG cut inside its pixel data")}


def with_image(model: str, url: str, path: str) -> dict[str, Any]:
    if path.endswith("/responses"):
        return {"model": model, "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": url}]}]}
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.mark.parametrize("case", sorted(BROKEN_IMAGES))
def test_a_broken_inline_image_is_a_400_where_stock_gives_a_500(servers: dict[str, PatchedServer], case: str) -> None:
    patched, stock = servers["patched"], servers["stock"]
    body = with_image(str(patched.model_dir), BROKEN_IMAGES[case], "/v1/chat/completions")
    status, reply = patched.request("POST", "/v1/chat/completions", body)
    assert status == 400 and "inline image" in reply["detail"], (case, status, reply)
    assert stock.request("POST", "/v1/chat/completions", body)[0] == 500, case  # what the row says of stock
    responses = with_image(str(patched.model_dir), BROKEN_IMAGES[case], "/v1/responses")
    status, reply = patched.request("POST", "/v1/responses", responses)
    assert status == 400 and "inline image" in json.dumps(reply), (case, status, reply)
    data = BROKEN_IMAGES[case].split(",", 1)[1]  # Anthropic's base64 block of the same bytes
    messages = {"model": str(patched.model_dir), "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}]}
    status, reply = patched.request("POST", "/v1/messages", messages)
    assert status == 400 and "inline image" in json.dumps(reply), (case, status, reply)
    assert stock.request("POST", "/v1/messages", messages)[0] == 500, case
    assert patched.chat([{"role": "user", "content": "Still there?"}], max_tokens=2)["choices"]
