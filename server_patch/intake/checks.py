"""Shape checks on a parsed inference body that stock mlx-vlm answers with a 500 (or worse).

Each check names what is wrong in words a client can act on; the body guard answers 400 with
it. Only what stock cannot handle is refused: everything else stays mlx-vlm's to judge.
"""

from __future__ import annotations

import os
import re
from typing import Any

# A lone UTF-16 surrogate: valid JSON (``"\ud800"``) but no Unicode text; the tokenizer raises.
_SURROGATE = re.compile("[\ud800-\udfff]")
# Routes whose ``messages`` stock renders through the chat template, which raises on an empty list.
MESSAGE_ROUTES = frozenset({"/chat/completions", "/v1/chat/completions", "/messages", "/v1/messages",
                            "/messages/count_tokens", "/v1/messages/count_tokens"})


def too_deep(data: Any, max_depth: int) -> bool:
    """Whether arrays and objects nest deeper than ``max_depth`` (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def has_lone_surrogate(data: Any) -> bool:
    """Whether any string (object keys included) holds a UTF-16 surrogate that is not in a pair."""
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def refusal(path: str, data: Any, max_depth: int) -> str | None:
    """Why this parsed body cannot be served (a 400), or None."""
    if too_deep(data, max_depth):
        return f"request JSON nests deeper than {max_depth} levels (APC_INFERENCE_MAX_JSON_DEPTH)"
    if has_lone_surrogate(data):
        return "request JSON holds a lone UTF-16 surrogate (\\ud800-\\udfff outside a pair): not valid text"
    if path in MESSAGE_ROUTES and isinstance(data, dict) and data.get("messages") == []:
        return "messages must hold at least one message"
    from server_patch.speculative.support import logprobs_refusal

    return logprobs_refusal(path, data, os.environ)  # mlx-vlm's speculation reports them as 0.0
